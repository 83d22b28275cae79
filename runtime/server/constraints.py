"""The one constraint an OpenAI request asks for, whichever server's field names it:
SGLang's `regex` / `json_schema` / `ebnf`, OpenAI's `response_format`, vLLM's legacy
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (with
`guided_whitespace_pattern`) and its `structured_outputs` object.

Each becomes one sampling parameter (`regex`, `json_schema` or `ebnf`: a grammar field is
handed to `ebnf`, whose validation answers for it). Two constraints in one request, or
one sprig cannot enforce (`structural_tag`), are a 400 naming the field; none is ever
dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sprig.runtime.constrained.base import JSON_WHITESPACE
from sprig.runtime.constrained.json_schema import admits_free_form, schema_to_regex
from sprig.runtime.constrained.regex_text import escape_literal
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StructuredOutputs,
)

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    """`key`: the sampling parameter; `field`: the request field it came from (a key of
    `structured_outputs` is named with its path)."""

    field: str
    key: str
    value: Any

    @property
    def param(self) -> str:
        """The top-level request field, as errors name it."""
        return self.field.split(".")[0]


def request_constraint(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The request's constraint, or None. Raises ApiError (400) for two, or a bad one."""
    found = [c for c in (*_sglang(req), _response_format(req), *_guided(req), _structured(req.structured_outputs))
             if c is not None]
    if len(found) > 1:
        raise ApiError(400, f"give one constraint; the request has {found[0].field} and {found[1].field}",
                       found[1].param)
    return found[0] if found else None


def response_format_regex(constraint: Constraint, free_form: bool = False) -> str | None:
    """The regex of a `response_format` constraint (a JSON schema, as `_response_format`
    makes it), with the whitespace the constraint alone is compiled with; None for a
    schema with free-form JSON (`json_object` among them), unless `free_form`: its regex
    only llguidance compiles fast, and the grammar router sends such a schema there as a
    schema, not as a regex (`constrained.routing`)."""
    schema = constraint.value if isinstance(constraint.value, str) else json.dumps(constraint.value)
    if admits_free_form(schema) and not free_form:
        return None
    try:
        return schema_to_regex(schema, JSON_WHITESPACE)
    except ValueError as e:
        raise ApiError(400, f"{constraint.field}: {e}", constraint.param) from None


def _sglang(req: CompletionRequest | ChatCompletionRequest) -> list[Constraint | None]:
    return [None if getattr(req, key) is None else Constraint(key, key, getattr(req, key))
            for key in ("regex", "json_schema", "ebnf")]


def _response_format(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("response_format", "json_schema", ANY_OBJECT)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
    return Constraint("response_format", "json_schema", fmt.json_schema.schema_)


def _guided(req: CompletionRequest | ChatCompletionRequest) -> list[Constraint | None]:
    if req.guided_whitespace_pattern is not None and req.guided_json is None:
        raise ApiError(400, "guided_whitespace_pattern applies to guided_json only", "guided_whitespace_pattern")
    return [
        _json("guided_json", req.guided_json, req.guided_whitespace_pattern),
        None if req.guided_regex is None else Constraint("guided_regex", "regex", req.guided_regex),
        _choice("guided_choice", req.guided_choice),
        None if req.guided_grammar is None else Constraint("guided_grammar", "ebnf", req.guided_grammar),
    ]


def _structured(so: StructuredOutputs | None) -> Constraint | None:
    if so is None:
        return None
    field = "structured_outputs"
    if so.structural_tag is not None:
        raise ApiError(400, f"{field}.structural_tag is not supported; use json, regex, choice or grammar",
                       field)
    found = [c for c in (
        _json(f"{field}.json", so.json_, so.whitespace_pattern),
        None if so.regex is None else Constraint(f"{field}.regex", "regex", so.regex),
        _choice(f"{field}.choice", so.choice),
        None if so.grammar is None else Constraint(f"{field}.grammar", "ebnf", so.grammar),
        Constraint(f"{field}.json_object", "json_schema", ANY_OBJECT) if so.json_object else None,
    ) if c is not None]
    if so.whitespace_pattern is not None and so.json_ is None:
        raise ApiError(400, f"{field}.whitespace_pattern applies to {field}.json only", field)
    if len(found) > 1:
        raise ApiError(400, f"{field} may name one constraint; it has {found[0].field} and {found[1].field}", field)
    return found[0] if found else None


def _json(field: str, schema: str | dict[str, Any] | None, whitespace: str | None) -> Constraint | None:
    """A JSON-schema constraint; with a whitespace pattern, as the regex of the schema
    with that pattern between JSON tokens."""
    if schema is None:
        return None
    if whitespace is None:
        return Constraint(field, "json_schema", schema)
    try:
        return Constraint(field, "regex", schema_to_regex(schema if isinstance(schema, str) else json.dumps(schema),
                                                          whitespace))
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", field.split(".")[0]) from None


def _choice(field: str, options: list[str] | None) -> Constraint | None:
    if options is None:
        return None
    if not options:
        raise ApiError(400, f"{field} must list at least one choice", field.split(".")[0])
    return Constraint(field, "regex", "(?:" + "|".join(escape_literal(o) for o in options) + ")")
