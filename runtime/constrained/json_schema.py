"""JSON Schema → regex: outlines-core's `build_regex_from_schema`, minus its silent gaps.

outlines-core drops keywords it cannot express, so its regex admits outputs that violate
the schema. Before calling it, this module walks the schema and, for every keyword whose
loss would admit an invalid output, either enforces it or refuses the schema with a
`ValueError` naming the keyword and where it is (the server answers 400):

- enforced: integer and number bounds (`minimum`, `maximum`, `exclusive*`, as range
  regexes; number bounds must be integers), string `pattern` (rewritten to raw JSON
  string content), `format` (sprig's own table), `enum` filtered by `type`;
- refused: `multipleOf`, `uniqueItems`, `contains`, `not`, `if`/`then`/`else`,
  `patternProperties`, `propertyNames`, `dependent*`, `allOf` of several schemas,
  `oneOf` whose branches may overlap, and combinations outlines mishandles (a `pattern`
  or `format` with a length, a `$ref` with siblings, `required` names missing from
  `properties`, property names that need JSON escapes, ...).

An enforced subschema is swapped for a placeholder `const` string; its quoted text in
outlines' regex is then replaced by the enforced regex. Keywords that only widen what a
valid output may be (`additionalProperties` beside `properties`, annotations) are safe to
drop: the generated outputs are a subset of the valid ones.

A subschema of annotations only (`{}`, pydantic's `{"title": ...}` for `Any`) admits any
JSON value. outlines-core refuses the annotated one and, for `{}` inside an object or
array, splices its any-value alternation in without parentheses (`{"a":` then `true` OR
`null` OR ...: outputs that are not JSON); here both become a placeholder for that
alternation, grouped. Free-form JSON (such a value, an object with no properties, an
array with no items) makes a regex of thousands of characters, whose token automaton
outlines-core takes seconds to minutes to build: `admits_free_form` says which schemas
have it (the grammar router sends those to llguidance).
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Callable
from typing import Any

from outlines_core import Index
from outlines_core.json_schema import build_regex_from_schema

from sprig.runtime.constrained.json_rules import ANNOTATIONS, ENFORCED, REFUSALS, type_matches
from sprig.runtime.constrained.json_values import (
    FORMATS,
    VALUE_RULES,
    int_bounds,
    number_bounds,
)
from sprig.runtime.constrained.numeric_ranges import integer_range_regex, number_range_regex
from sprig.runtime.constrained.regex_text import ascii_digits, check_supported, json_string_pattern
from sprig.runtime.constrained.vocabulary import (
    BYTE_EOS,
    BYTE_MARK,
    END_MARK,
    byte_vocabulary,
    marked,
)

_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_VALUES = frozenset({"items", "additionalProperties"})
_JSON_BLANKS = frozenset(b" \t\n\r")
_JSON_UNSAFE_BYTES = frozenset({ord('"'), ord("\\"), *range(0x20)})


def admitted_bytes(regex: str) -> set[int]:
    """Every byte some string of `regex`'s language contains, but END_MARK's (exact
    unless the regex itself spells END_MARK); `ValueError` if invalid."""
    index = Index(marked(regex), byte_vocabulary())
    found = {b for moves in index.get_transitions().values() for b in moves}
    return found - {BYTE_EOS, BYTE_MARK, *END_MARK.encode()}


def _string_regex(node: dict[str, Any], path: str) -> str | None:
    if "pattern" in node:
        try:
            inner = json_string_pattern(node["pattern"])
            check_supported(inner)
            unsafe = admitted_bytes(inner) & _JSON_UNSAFE_BYTES
        except ValueError as e:
            raise ValueError(f"json_schema pattern at {path}: {e}") from None
        if unsafe:
            raise ValueError(
                f"json_schema pattern at {path} admits characters a JSON string must escape "
                f"({', '.join(repr(chr(b)) for b in sorted(unsafe))}); exclude them"
            )
        return f'"{inner}"'
    if "format" in node:
        return f'"{FORMATS[node["format"]]}"'
    return None


def _integer_regex(node: dict[str, Any], path: str) -> str | None:
    lo, hi = int_bounds(node, path)
    return None if lo is None and hi is None else integer_range_regex(lo, hi)


def _number_regex(node: dict[str, Any], path: str) -> str | None:
    lo, hi = number_bounds(node, path)
    return None if lo is None and hi is None else number_range_regex(lo, hi)


# A regex for a single-typed node whose keywords outlines would drop, or None.
_ENFORCERS: dict[str, Callable[[dict[str, Any], str], str | None]] = {
    "string": _string_regex,
    "integer": _integer_regex,
    "number": _number_regex,
}


@functools.lru_cache(maxsize=8)
def _any_value_regex(whitespace: str) -> str:
    """outlines-core's regex of any JSON value (nesting bounded), with `whitespace`."""
    return build_regex_from_schema("{}", whitespace_pattern=whitespace)


def _free_container(node: dict[str, Any]) -> bool:
    """An object node with no properties (nor a schema or `false` for other ones), or an
    array node with no items: outlines-core gives either any JSON values inside."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    free_object = "properties" not in node and node.get("additionalProperties", True) is True
    return ("object" in types and free_object) or ("array" in types and not node.keys() & {"items", "prefixItems"})


class _Rewriter:
    """Walks a schema; collects placeholder → regex in `slots`, and notes in `free_form`
    whether some value may be any JSON."""

    def __init__(self, root: dict[str, Any], whitespace: str) -> None:
        self.root = root
        self.whitespace = whitespace
        self.slots: dict[str, str] = {}
        self.free_form = False
        self._nonce = secrets.token_hex(8)

    def node(self, schema: Any, path: str) -> Any:
        if not isinstance(schema, dict):
            return schema  # `true`/`false` subschemas, or a malformed value outlines rejects
        if not schema.keys() - ANNOTATIONS:  # any JSON value
            self.free_form = True
            return self._slot(_any_value_regex(self.whitespace))
        self.free_form |= _free_container(schema)
        for keyword in schema.keys() & VALUE_RULES.keys():
            ok, rule = VALUE_RULES[keyword]
            if not ok(schema[keyword]):
                raise ValueError(f"json_schema keyword {keyword!r} at {path} must be {rule}")
        for keyword in schema.keys() & REFUSALS.keys():
            reason = REFUSALS[keyword](schema, self.root)
            if reason is not None:
                raise ValueError(f"json_schema keyword {keyword!r} at {path}: {reason}")
        out = {k: self._children(k, v, path) for k, v in schema.items()}
        types = out.get("type")
        if isinstance(types, list) and ENFORCED & out.keys():
            return {"anyOf": [self.node({**out, "type": t}, path) for t in types]}
        if "enum" in out:
            return self._enum(out, path)
        enforce = _ENFORCERS.get(types) if isinstance(types, str) else None
        regex = enforce(out, path) if enforce is not None and "const" not in out else None
        return out if regex is None else self._slot(regex)

    def _children(self, key: str, value: Any, path: str) -> Any:
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            return {k: self.node(v, f"{path}/{key}/{k}") for k, v in value.items()}
        if key in _SCHEMA_LISTS and isinstance(value, list):
            return [self.node(v, f"{path}/{key}/{i}") for i, v in enumerate(value)]
        if key in _SCHEMA_VALUES:
            return self.node(value, f"{path}/{key}")
        return value

    def _enum(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        if "type" not in node:
            return node
        kept = [v for v in node["enum"] if type_matches(v, node["type"])]
        if not kept:
            raise ValueError(f"json_schema enum at {path} has no value of type {node['type']}")
        return {**node, "enum": kept}

    def _slot(self, regex: str) -> dict[str, str]:
        token = f"sprig{self._nonce}slot{len(self.slots)}"
        self.slots[token] = regex
        return {"const": token}


def _check_whitespace(whitespace: str) -> None:
    check_supported(whitespace)
    if not admitted_bytes(whitespace) <= _JSON_BLANKS:
        raise ValueError(f"whitespace pattern {whitespace!r} admits non-whitespace characters")


def admits_free_form(text: str) -> bool:
    """Whether some value of the JSON schema `text` may be any JSON: an annotation-only
    subschema, an object with no properties, an array with no items (in `$defs` too).
    False for a schema `schema_to_regex` refuses (its compile says why)."""
    try:
        schema = json.loads(text)
        rewriter = _Rewriter(schema, "")
        rewriter.node(schema, "#")
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return False
    return isinstance(schema, dict) and rewriter.free_form


def schema_to_regex(text: str, whitespace: str = "") -> str:
    """The regex of `text` (a JSON schema) with `whitespace` between JSON tokens ("" =
    compact); every string it matches validates against the schema."""
    try:
        return _convert(text, whitespace)
    except RecursionError:
        raise ValueError("json_schema is nested too deeply") from None


def _convert(text: str, whitespace: str) -> str:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object; got {type(schema).__name__}")
    if whitespace:
        _check_whitespace(whitespace)
    rewriter = _Rewriter(schema, whitespace)
    try:
        rewritten = rewriter.node(schema, "#")
    except (TypeError, AttributeError, KeyError) as e:  # a keyword with a value of the wrong type
        raise ValueError(f"json_schema is malformed: {type(e).__name__}: {e}") from None
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), whitespace_pattern=whitespace)
    except (ValueError, TypeError) as e:  # TypeError: serde_json refuses nesting past 128
        raise ValueError(f"json_schema not supported: {e}") from None
    for token, slot_regex in rewriter.slots.items():
        regex = regex.replace(f'"{token}"', f"(?:{slot_regex})")
    return ascii_digits(regex)
