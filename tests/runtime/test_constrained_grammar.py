"""The outlines backend driven like the scheduler drives it: random walks over the tiny
tokenizer that take only bitmask-allowed tokens must produce outputs matching their
regex / validating against their schema; EOS is masked until a final state."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from sprig.kernels.logit_mask import unpack_bitmask
from sprig.runtime.constrained import GrammarSpec, OutlinesBackend, bitmask_width

EXTRA_LOGITS = 40  # the model's logits row is wider than the tokenizer
END = 3  # "<|end|>", another stop token of the tiny chat model
WALKS = 12


@pytest.fixture(scope="module")
def backend(tokenizer) -> OutlinesBackend:
    return OutlinesBackend.from_tokenizer(tokenizer, logits_width=len(tokenizer) + EXTRA_LOGITS)


def allowed_ids(grammar, width: int) -> list[int]:
    row = torch.full((bitmask_width(width),), -1, dtype=torch.int32)
    grammar.fill_bitmask(row)
    return unpack_bitmask(row[None], width)[0].nonzero().flatten().tolist()


def walk(backend, grammar, rng: random.Random, *, stops=(2, END), max_steps=300) -> bytes:
    """Take random allowed tokens until a stop token; checks the stop/EOS invariants."""
    width = len(backend.vocabulary) + EXTRA_LOGITS
    out: list[int] = []
    forced: list[tuple[int, str]] = []  # (bytes so far, the forced continuation there)
    for _ in range(max_steps):
        text = b"".join(backend.vocabulary.token_bytes[i] for i in out)
        forced.append((len(text), grammar.forced_continuation() or ""))
        allowed = allowed_ids(grammar, width)
        assert all(i < len(backend.vocabulary) for i in allowed)  # extra logits ids: never
        for stop in stops:
            assert (stop in allowed) == grammar.is_terminated()
        content = [i for i in allowed if i not in stops]
        assert grammar.is_finished() == (not content)
        if not content or (grammar.is_terminated() and rng.random() < 0.3):
            stop = rng.choice(stops)
            assert grammar.accept_token(stop) and grammar.is_finished()
            for at, prefix in forced:  # every valid completion starts with the forced text
                assert text[at:].startswith(prefix.encode())
            return text
        token = rng.choice(content)
        assert grammar.accept_token(token)
        out.append(token)
    raise AssertionError("walk did not terminate")


def outputs(backend, spec: GrammarSpec, seeds=range(WALKS)) -> tuple[str, list[str]]:
    compiled = backend.compile(spec)
    texts = []
    for seed in seeds:
        grammar = backend.matcher(compiled, stop_token_ids=(2, END))
        texts.append(walk(backend, grammar, random.Random(seed)).decode())
    return compiled.regex, texts


REGEXES = [
    r"-?(0|[1-9][0-9]{0,5})",
    r"-?(0|[1-9][0-9]*)\.[0-9]{1,4}",
    r"(yes|no|maybe)",
    r"[a-z]{3,8}@example\.com",
    r"\d{3}-\d{4}",
    r"(é|ü|中文| ){1,4}",
    r"\[(\d+, ){0,3}\d+\]",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_match_their_regex(backend, regex):
    compiled_regex, texts = outputs(backend, GrammarSpec.regex(regex))
    for text in texts:
        assert re.fullmatch(regex, text), text
        assert re.fullmatch(compiled_regex, text)
        assert all(ch in "0123456789" for ch in text if ch.isdigit())  # \d means ASCII


def test_random_walks_pick_one_choice(backend):
    options = ["Paris", "London", "New York", "a.b*c (d)", ""]
    _, texts = outputs(backend, GrammarSpec.choices(options))
    assert set(texts) <= set(options) and len(set(texts)) > 1


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 130},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "grid": {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 3,
            },
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "grid"],
}
SCHEMAS = [
    {"type": "integer"},
    {"type": "integer", "minimum": -40, "maximum": 1234},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7},
    {"type": "number", "minimum": -1, "exclusiveMaximum": 3},
    {"type": "number"},
    {"enum": ["red", "green", 3, None, True]},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"},
    {"type": "string", "format": "date"},
    {"anyOf": [{"type": "integer", "minimum": 100}, {"type": "null"}]},
    {"type": ["string", "integer"], "maxLength": 3, "maximum": -7},
    NESTED,
    {
        "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
        "$defs": {
            "cat": {
                "type": "object",
                "properties": {
                    "kind": {"const": "cat"},
                    "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["kind", "lives"],
            },
            "dog": {
                "type": "object",
                "properties": {"kind": {"const": "dog"}},
                "required": ["kind"],
            },
        },
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_random_walks_validate_against_their_schema(backend, schema):
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    compiled_regex, texts = outputs(backend, GrammarSpec.json_schema(schema))
    for text in texts:
        assert re.fullmatch(compiled_regex, text)
        validator.validate(json.loads(text))


def test_whitespace_pattern_is_honoured(backend):
    spec = GrammarSpec.json_schema(NESTED, whitespace=r"[ \n]{0,2}")
    _, texts = outputs(backend, spec, seeds=range(6))
    for text in texts:
        jsonschema.validate(json.loads(text), NESTED)
    assert any(" " in t.replace('" ', "").replace(' "', "") or "\n" in t for t in texts)
