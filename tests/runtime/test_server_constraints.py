"""Which constraint an OpenAI request asks for, from every field that names one: each maps
onto one sampling parameter, and the regexes built here match what they should."""

from __future__ import annotations

import json
import re

import pytest

from sprig.runtime.server.constraints import ANY_OBJECT, request_constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def constraint(**fields):
    return request_constraint(ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                                    **fields}))


@pytest.mark.parametrize(("fields", "field", "key", "value"), [
    ({"regex": "a+"}, "regex", "regex", "a+"),
    ({"json_schema": SCHEMA}, "json_schema", "json_schema", SCHEMA),
    ({"ebnf": 'root ::= "a"'}, "ebnf", "ebnf", 'root ::= "a"'),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_schema", ANY_OBJECT),
    ({"guided_json": SCHEMA}, "guided_json", "json_schema", SCHEMA),
    ({"guided_regex": "a+"}, "guided_regex", "regex", "a+"),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "ebnf", 'root ::= "a"'),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", "regex", "a+"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar", "ebnf", 'root ::= "a"'),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", "json_schema", ANY_OBJECT),
])
def test_each_field_maps_onto_one_parameter(fields: dict, field: str, key: str, value) -> None:
    c = constraint(**fields)
    assert (c.field, c.key, c.value, c.param) == (field, key, value, field.split(".")[0])


def test_choices_become_a_regex_of_exactly_those_strings() -> None:
    options = ["yes", "no", "a.b (c)", "x|y", "[1]*"]
    for fields in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        regex = constraint(**fields).value
        assert all(re.fullmatch(regex, o) for o in options)
        assert not any(re.fullmatch(regex, o) for o in ["ye", "a.b (cc)", "x", "1", "yesno", "axb (c)"])


def test_a_whitespace_pattern_becomes_the_schema_regex_with_that_whitespace() -> None:
    for fields in ({"guided_json": SCHEMA, "guided_whitespace_pattern": "\n"},
                   {"structured_outputs": {"json": json.dumps(SCHEMA), "whitespace_pattern": "\n"}}):
        c = constraint(**fields)
        assert c.key == "regex"
        assert re.fullmatch(c.value, '{\n"n"\n:\n12\n}') and not re.fullmatch(c.value, '{"n":12}')


def test_none_and_no_op_fields() -> None:
    assert constraint() is None and constraint(response_format={"type": "text"}) is None
    assert constraint(structured_outputs={"json_object": False, "disable_fallback": True}) is None
    assert constraint(guided_decoding_backend="xgrammar") is None
    req = CompletionRequest.model_validate({"prompt": "x", "guided_choice": ["a"]})
    assert request_constraint(req).field == "guided_choice"


@pytest.mark.parametrize(("fields", "param"), [
    ({"regex": "a", "guided_regex": "b"}, "guided_regex"),
    ({"json_schema": SCHEMA, "response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"type": "x"}}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_bad_or_several_constraints_are_400(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        constraint(**fields)
    assert (e.value.status, e.value.param) == (400, param)
