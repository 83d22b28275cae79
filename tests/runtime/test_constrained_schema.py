"""JSON Schema → regex: every keyword outlines-core would drop is enforced or refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.runtime.constrained.json_schema import admits_free_form, admitted_bytes, schema_to_regex
from sprig.runtime.constrained.json_values import FORMATS

UNSAFE = {ord('"'), ord("\\"), *range(0x20)}


def regex_of(schema: dict, whitespace: str = "") -> re.Pattern:
    return re.compile(schema_to_regex(json.dumps(schema), whitespace))


@pytest.mark.parametrize(
    "schema, accepted, rejected",
    [
        (
            {"type": "integer", "minimum": 3, "maximum": 10},
            ["3", "7", "10"],
            ["2", "11", "-3", "03"],
        ),
        (
            {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 10},
            ["4", "9"],
            ["3", "10"],
        ),
        ({"type": "integer", "minimum": 2.5, "maximum": 4.5}, ["3", "4"], ["2", "5"]),
        (
            {
                "$schema": "http://json-schema.org/draft-04/schema#",
                "type": "integer",
                "minimum": 0,
                "exclusiveMinimum": True,
            },
            ["1"],
            ["0", "-1"],
        ),
        (
            {"type": "number", "minimum": -1, "maximum": 1},
            ["-1", "0.5", "1.0", "-0.99"],
            ["1.01", "-1.5", "1e0"],
        ),
        ({"type": "number", "exclusiveMaximum": 0}, ["-0.001", "-7"], ["0", "0.0", "3"]),
        ({"type": ["integer", "null"], "maximum": 5}, ["5", "null"], ["6"]),
        ({"type": "string", "pattern": "^[a-z]{2}$"}, ['"ab"'], ['"abc"', '"A1"']),
        ({"type": "string", "pattern": "a.c"}, ['"abc"', '"a c"'], ['"a"c"', '"a\\\\c"', '"a\nc"']),
        ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2023-02-29"', '"2024-13-01"']),
        ({"type": "integer", "enum": [1, "a", 2.0]}, ["1", "2.0"], ['"a"']),
        ({"type": "string", "pattern": r"\d+"}, ['"123"'], ['"١٢٣"']),
    ],
)
def test_enforced_keywords(schema, accepted, rejected):
    rx = regex_of(schema)
    for text in accepted:
        assert rx.fullmatch(text), text
        jsonschema.validate(json.loads(text), schema)
    for text in rejected:
        assert not rx.fullmatch(text), text


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        ({"type": "number", "minimum": 0.5}, "must be integers"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"not": {"type": "integer"}}, "negation"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "conditional"),
        ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        (
            {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}},
            "dependentRequired",
        ),
        ({"type": "object", "minProperties": 1}, "minProperties"),
        ({"type": "object", "maxProperties": 1}, "maxProperties"),
        ({"allOf": [{"type": "integer"}, {"type": "integer"}]}, "allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, r"\['b'\]"),
        ({"type": "object", "properties": {'a"b': {}}}, "JSON escapes"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2}, "prefixItems"),
        ({"type": "string", "pattern": "a", "maxLength": 3}, "pattern combined with maxLength"),
        ({"type": "string", "format": "hostname"}, "format 'hostname' is not supported"),
        ({"type": "string", "pattern": 'a"'}, "must escape"),
        ({"type": "string", "pattern": "(?=a)"}, "lookahead"),
        ({"$ref": "#/$defs/n", "maximum": 3, "$defs": {"n": {"type": "integer"}}}, r"\$ref"),
        ({"enum": [1, 2], "minimum": 2}, "list only the allowed values"),
        ({"type": "integer", "const": "x"}, "not of type"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ],
)
def test_unenforceable_keywords_are_refused(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_to_regex(json.dumps(schema))


def test_safe_companions_pass():
    """Keywords that only narrow outputs to a subset, or are annotations, compile."""
    regex_of({"$ref": "#/$defs/n", "$defs": {"n": {"type": "integer", "title": "N"}}})
    regex_of(
        {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    )
    regex_of({"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 1})
    regex_of({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 1})
    regex_of({"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]})


@pytest.mark.parametrize("any_value", [{}, {"title": "Data", "description": "anything"}])
def test_a_subschema_of_annotations_only_admits_any_json_value_and_nothing_else(any_value):
    """`{}` inside an object or array (outlines-core spliced its any-value alternation in
    ungrouped: `{"a":true` and a bare `null` matched, `{"a":1}` did not), and pydantic's
    `{"title": ...}` for an `Any` field (outlines-core refused it)."""
    obj = regex_of({"type": "object", "properties": {"a": any_value}, "required": ["a"]}, " ?")
    for text in ['{"a":1}', '{"a": null}', '{"a":{"b":[1,"x"]}}', '{"a":"s"}']:
        assert obj.fullmatch(text), text
        jsonschema.validate(json.loads(text), {"type": "object", "required": ["a"]})
    for text in ["null", '"x"', '{"a":true', '{"a":1', "1}"]:
        assert not obj.fullmatch(text), text
    items = regex_of({"type": "array", "items": any_value})
    assert items.fullmatch('[1,"x",{"k":[]}]') and not items.fullmatch("null]") and not items.fullmatch("[1")
    assert regex_of(any_value).fullmatch('{"x":[true,null]}')


@pytest.mark.parametrize(
    "schema, free",
    [
        ({}, True),
        ({"type": "object"}, True),
        ({"type": "array"}, True),
        ({"type": ["object", "null"]}, True),
        ({"type": "object", "properties": {"a": {"title": "A"}}}, True),
        ({"type": "array", "items": {"type": "object"}}, True),
        ({"$defs": {"X": {"type": "array"}}, "$ref": "#/$defs/X"}, True),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, False),
        ({"type": "object", "additionalProperties": {"type": "integer"}}, False),
        ({"type": "array", "items": {"type": "string"}}, False),
        ({"type": "object", "properties": {}}, False),
        ({"type": "integer", "multipleOf": 2}, False),  # refused: its compile says why
    ],
)
def test_free_form_json_is_named(schema, free):
    assert admits_free_form(json.dumps(schema)) is free


def test_whitespace_must_be_json_whitespace():
    assert regex_of({"type": "array"}, r"[ \t\n\r]*").fullmatch("[ 1,\n\t2 ]")
    with pytest.raises(ValueError, match="non-whitespace"):
        schema_to_regex('{"type": "array"}', r"[ ,]?")


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_formats_never_need_json_escapes(name):
    assert not admitted_bytes(FORMATS[name]) & UNSAFE
    assert all(b < 0x80 for b in admitted_bytes(FORMATS[name]))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_format_strings_pass_the_format_checker(data):
    name = data.draw(st.sampled_from(["date", "email", "ipv4", "uuid"]))
    text = data.draw(st.from_regex(FORMATS[name], fullmatch=True))
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert checker.conforms(text, name), (name, text)
