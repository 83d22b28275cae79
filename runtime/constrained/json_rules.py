"""The JSON Schema keyword rules of `json_schema`: which keywords sprig refuses, and why.

`REFUSALS[keyword](node, root)` returns the reason `node` cannot be enforced, or None.
Every rule here exists because outlines-core would otherwise drop the keyword (or
mishandle it) and admit outputs that fail validation; each was found by experiment on
outlines-core 0.2.14.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sprig.runtime.constrained.json_values import FORMATS

_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
ENFORCED = frozenset({*_NUMERIC, "pattern", "format"})  # keywords enforced per single type
_LENGTHS = ("minLength", "maxLength")
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$anchor",
        "discriminator",
    }
)

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: type(v) is int or (type(v) is float and v.is_integer()),
    "number": lambda v: type(v) in (int, float),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _types(node: dict[str, Any]) -> list[str]:
    t = node.get("type", [])
    return [t] if isinstance(t, str) else t


def type_matches(value: Any, types: str | list[str]) -> bool:
    """Whether a JSON value is of one of the JSON Schema `types`."""
    return any(
        _JSON_TYPES.get(t, lambda _: False)(value)
        for t in ([types] if isinstance(types, str) else types)
    )


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """Follow local `$ref`s ("#/a/b"); an unresolvable one resolves to None."""
    for _ in range(32):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        target: Any = root
        for part in schema["$ref"].removeprefix("#").strip("/").split("/"):
            if part:
                target = target.get(part) if isinstance(target, dict) else None
        schema = target
    return None


def _kinds(schema: Any) -> frozenset[str] | None:
    """JSON kinds a subschema's values may have (numbers as one kind); None = unknown."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        names = (next(t for t, ok in _JSON_TYPES.items() if ok(v)) for v in values)
    elif "type" in schema:
        names = iter(_types(schema))
    else:
        return None
    return frozenset("number" if t == "integer" else t for t in names)


def _single_value(schema: Any) -> list[Any]:
    if isinstance(schema, dict) and "const" in schema:
        return [schema["const"]]
    if (
        isinstance(schema, dict)
        and isinstance(schema.get("enum"), list)
        and len(schema["enum"]) == 1
    ):
        return schema["enum"]
    return []


def _discriminated(branches: list[Any], root: dict[str, Any]) -> bool:
    """Every branch an object requiring one property with a distinct single value."""
    tags: list[dict[str, str]] = []
    for branch in branches:
        if not isinstance(branch, dict):
            return False
        props, required = branch.get("properties", {}), set(branch.get("required", ()))
        tags.append(
            {
                k: json.dumps(v[0], sort_keys=True)
                for k, s in props.items()
                if k in required and (v := _single_value(_resolve(s, root)))
            }
        )
    common = set.intersection(*(set(t) for t in tags))
    return any(len({t[k] for t in tags}) == len(tags) for k in common)


def _one_of(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    branches = [_resolve(b, root) for b in node["oneOf"]]
    kinds = [_kinds(b) for b in branches]
    if all(k is not None for k in kinds) and sum(map(len, kinds)) == len(frozenset().union(*kinds)):
        return None
    if _discriminated(branches, root):
        return None
    return "oneOf branches that may overlap cannot be enforced (exactly one must match); use anyOf, disjoint types, or a const discriminator property"


def _always(reason: str) -> Callable[[dict[str, Any], dict[str, Any]], str]:
    return lambda node, root: reason


def _siblings(node: dict[str, Any], keyword: str) -> set[str]:
    """Keywords beside `keyword` that constrain the node (not annotations, not $defs)."""
    return set(node) - ANNOTATIONS - {keyword, "$defs", "definitions"}


def _string_combo(node: dict[str, Any], keyword: str) -> str | None:
    if "string" not in _types(node):
        return None
    others = [k for k in (*_LENGTHS, "pattern", "format") if k in node and k != keyword]
    if others:
        return f"{keyword} combined with {', '.join(others)} cannot be enforced; use one"
    if keyword == "format" and node["format"] not in FORMATS:
        return f"format {node['format']!r} is not supported (supported: {', '.join(FORMATS)})"
    return None


def _literal(node: dict[str, Any], keyword: str) -> str | None:
    extra = [k for k in (*ENFORCED, *_LENGTHS, "multipleOf") if k in node]
    if extra:
        return f"{keyword} combined with {', '.join(extra)}: list only the allowed values"
    if keyword == "const" and "type" in node and not type_matches(node["const"], node["type"]):
        return f"const {node['const']!r} is not of type {node['type']}"
    return None


def _required(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    missing = [k for k in node["required"] if k not in node.get("properties", {})]
    return f"required properties {missing} are not in properties" if missing else None


def _property_names(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    bad = [k for k in node["properties"] if json.dumps(k, ensure_ascii=False)[1:-1] != k]
    return f"property names {bad} need JSON escapes, which are not supported" if bad else None


def _prefix_items(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    n = len(node["prefixItems"])
    if node.get("minItems", 0) <= n <= node.get("maxItems", n):
        return None
    return "prefixItems is generated exactly; minItems/maxItems that exclude its length cannot be enforced"


def _any_value(keyword: str, allowed: Callable[[dict[str, Any]], bool], reason: str):
    return lambda node, root: None if node[keyword] in (True, {}) or allowed(node) else reason


REFUSALS: dict[str, Callable[[dict[str, Any], dict[str, Any]], str | None]] = {
    "multipleOf": _always("multipleOf cannot be expressed as a regular expression"),
    "uniqueItems": lambda n, r: (
        None
        if n["uniqueItems"] is not True or n.get("maxItems", 2) <= 1
        else "uniqueItems cannot be expressed as a regular expression"
    ),
    "contains": _always("contains cannot be enforced"),
    "not": _always("negation cannot be enforced"),
    "if": _always("conditional subschemas cannot be enforced"),
    "patternProperties": _always("patternProperties cannot be enforced"),
    "propertyNames": _always("propertyNames cannot be enforced"),
    "dependentRequired": _always("dependencies between properties cannot be enforced"),
    "dependentSchemas": _always("dependencies between properties cannot be enforced"),
    "dependencies": _always("dependencies between properties cannot be enforced"),
    "unevaluatedProperties": _any_value(
        "unevaluatedProperties",
        lambda n: "properties" in n,
        "cannot be enforced without properties",
    ),
    "unevaluatedItems": _any_value(
        "unevaluatedItems", lambda n: "prefixItems" in n, "cannot be enforced without prefixItems"
    ),
    "minProperties": lambda n, r: (
        None
        if n["minProperties"] <= len(n.get("required", ()))
        else "minProperties beyond the required properties cannot be enforced; list them in required"
    ),
    "maxProperties": lambda n, r: (
        None
        if "properties" in n and len(n["properties"]) <= n["maxProperties"]
        else "maxProperties below the number of properties cannot be enforced"
    ),
    "allOf": lambda n, r: (
        None
        if len(n["allOf"]) == 1 and not _siblings(n, "allOf")
        else "allOf is supported only as a single subschema with no sibling keywords"
    ),
    "$ref": lambda n, r: (
        f"$ref with sibling keywords {sorted(_siblings(n, '$ref'))} cannot be enforced"
        if _siblings(n, "$ref")
        else None
    ),
    "oneOf": _one_of,
    "required": _required,
    "properties": _property_names,
    "prefixItems": _prefix_items,
    "pattern": lambda n, r: _string_combo(n, "pattern"),
    "format": lambda n, r: _string_combo(n, "format"),
    "enum": lambda n, r: _literal(n, "enum"),
    "const": lambda n, r: _literal(n, "const"),
}
