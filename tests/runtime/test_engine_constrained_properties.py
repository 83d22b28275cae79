"""Property tests of constrained decoding through the engine (random tiny model, temperature
1): random JSON schemas and random regexes, each in a batch with a free request, with
jump-forward on and off (outlines-core), and on llguidance with jump-forward on. Every
output validates; a refused schema fails only its request.

Every strategy is bounded (string lengths, item counts, integer ranges, regex repeats), and
each draws its worst-case output length beside it, so `max_new_tokens` always leaves room
for the grammar to finish: a request that ends by `length` is a failure here.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from engine_helpers import assert_idle_and_intact
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sprig.runtime import Engine

# A drawn (schema or regex, most output tokens it can take). Tokens <= UTF-8 bytes.
Bounded = tuple[Any, int]
NUMBER_SLACK = 96  # a number's fraction is unbounded in the regex; a random model ends it soon
FREE_TOKENS = 5
MAX_BOUND = 500  # the tiny model's context is 1024 tokens
WS = 1  # the default JSON whitespace `[ ]?`: at most one blank at each place it may stand
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


SETUPS = {"jump": ("outlines", True), "nojump": ("outlines", False), "llguidance-jump": ("llguidance", True)}


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """One engine per setup (grammar backend, jump-forward), shared by every example."""
    made = {name: Engine(tiny_llama, dtype="float32", check_integrity=True, enable_jump_forward=jump,
                         grammar_compile_timeout_s=30, grammar_backend=backend)
            for name, (backend, jump) in SETUPS.items()}
    yield made
    for eng in made.values():
        eng.shutdown()


# ------------------------------------------------------------------ schema strategies
NAMES = st.sampled_from(["a", "id", "name", "kind", "x1", "tag"])
SHORT_WORDS = st.text(alphabet="abcxyz01 ", min_size=0, max_size=4)
PATTERNS = st.sampled_from([("[a-z]{1,4}", 4), ("[0-9]{2}", 2), ("(ab|cd)x?", 3), ("[A-F][0-9]?", 2), ("q(-[a-c]){0,2}", 5)])


def _quoted(s: str) -> int:
    return len(json.dumps(s).encode())


@st.composite
def integers(draw) -> Bounded:
    lo = draw(st.integers(-60, 60))
    hi = lo + draw(st.integers(0, 300))
    return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))


@st.composite
def numbers(draw) -> Bounded:
    lo = draw(st.integers(-9, 9))
    hi = lo + draw(st.integers(1, 20))
    return {"type": "number", "minimum": lo, "maximum": hi}, NUMBER_SLACK


@st.composite
def strings(draw) -> Bounded:
    if draw(st.booleans()):
        pattern, length = draw(PATTERNS)
        return {"type": "string", "pattern": pattern}, length + 2
    hi = draw(st.integers(0, 6))
    lo = draw(st.integers(0, hi))
    return {"type": "string", "minLength": lo, "maxLength": hi}, 4 * hi + 2  # 4 bytes a char at most


@st.composite
def enums(draw) -> Bounded:
    values = draw(st.lists(st.one_of(SHORT_WORDS, st.integers(-99, 99), st.booleans()), min_size=1, max_size=4,
                           unique_by=json.dumps))
    return {"enum": values}, max(len(json.dumps(v).encode()) for v in values)


LEAVES = st.one_of(integers(), numbers(), strings(), enums(), st.just(({"type": "boolean"}, 5)))


@st.composite
def arrays(draw, items: st.SearchStrategy[Bounded]) -> Bounded:
    item, item_len = draw(items)
    hi = draw(st.integers(0, 3))
    lo = draw(st.integers(0, hi))
    return {"type": "array", "items": item, "minItems": lo, "maxItems": hi}, 2 + WS + hi * (item_len + 1 + WS)


@st.composite
def objects(draw, values: st.SearchStrategy[Bounded]) -> Bounded:
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    drawn = {n: draw(values) for n in names}
    required = [n for n in names if draw(st.booleans())]
    schema = {"type": "object", "properties": {n: s for n, (s, _) in drawn.items()}, "required": required}
    return schema, 2 + WS + sum(_quoted(n) + 2 + 4 * WS + length for n, (_, length) in drawn.items())


SCHEMAS = st.recursive(LEAVES, lambda inner: st.one_of(arrays(inner), objects(inner)), max_leaves=5)


@st.composite
def top_schemas(draw) -> tuple[dict, int, bool]:
    """An object at the top (its output within MAX_BOUND tokens); about one in eight
    carries `multipleOf`, which sprig refuses."""
    schema, length = draw(objects(SCHEMAS).filter(lambda drawn: drawn[1] <= MAX_BOUND))
    refused = draw(st.integers(0, 7)) == 7
    if refused:
        schema["properties"]["bad"] = {"type": "integer", "multipleOf": 3}
    return schema, length, refused


# ------------------------------------------------------------------ regex strategies
def _atom() -> st.SearchStrategy[tuple[str, int]]:
    literal = st.sampled_from("abcxyz019-").map(lambda c: (re.escape(c), 1))
    klass = st.sampled_from(["[a-z]", "[0-9]", "[abc]", "[^a-z\\n]", "\\d", "[A-Z_]"]).map(
        lambda c: (c, 4 if c.startswith("[^") else 1))
    return st.one_of(literal, klass)


def _extend(inner: st.SearchStrategy[tuple[str, int]]) -> st.SearchStrategy[tuple[str, int]]:
    concat = st.lists(inner, min_size=2, max_size=3).map(lambda ps: ("".join(p for p, _ in ps), sum(n for _, n in ps)))
    alt = st.lists(inner, min_size=2, max_size=3).map(lambda ps: ("(" + "|".join(p for p, _ in ps) + ")", max(n for _, n in ps)))

    @st.composite
    def repeat(draw) -> tuple[str, int]:
        pattern, n = draw(inner)
        hi = draw(st.integers(1, 3))
        lo = draw(st.integers(0, hi))
        op = draw(st.sampled_from(["?", f"{{{hi}}}", f"{{{lo},{hi}}}"]))
        times = 1 if op == "?" else hi
        return f"(?:{pattern}){op}", n * times

    return st.one_of(concat, alt, repeat())


REGEXES = st.recursive(_atom(), _extend, max_leaves=6)


# ------------------------------------------------------------------ the properties
def _run(engine: Engine, constrained: dict, bound: int, seed: int) -> tuple[dict, dict]:
    params = [
        {"max_new_tokens": bound + 8, "temperature": 1.0, "seed": seed, **constrained},
        {"max_new_tokens": FREE_TOKENS, "temperature": 1.0, "seed": seed + 1, "ignore_eos": True},
    ]
    outs = engine.generate(["value:", "free text"], params)
    assert_idle_and_intact(engine)
    free = outs[1]["meta_info"]
    assert free["completion_tokens"] == FREE_TOKENS and free["finish_reason"]["type"] == "length"
    if not engine.config.scheduler.enable_jump_forward:
        assert outs[0]["meta_info"]["jump_forward_tokens"] == 0
    return outs[0], outs[0]["meta_info"]["finish_reason"]


@pytest.mark.parametrize("setup", list(SETUPS))
@SETTINGS
@given(drawn=top_schemas(), seed=st.integers(0, 2**20))
def test_every_output_validates_against_its_random_schema(engines, setup, drawn, seed) -> None:
    schema, bound, refused = drawn
    out, reason = _run(engines[setup], {"json_schema": json.dumps(schema)}, bound, seed)
    if refused:
        assert reason["type"] == "abort" and reason["status_code"] == 400 and "multipleOf" in reason["message"], reason
        return
    assert reason["type"] == "stop", (schema, reason, out["text"])
    jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize("setup", list(SETUPS))
@SETTINGS
@given(drawn=REGEXES, seed=st.integers(0, 2**20))
def test_every_output_fully_matches_its_random_regex(engines, setup, drawn, seed) -> None:
    pattern, bound = drawn
    out, reason = _run(engines[setup], {"regex": pattern}, bound, seed)
    assert reason["type"] == "stop", (pattern, reason, out["text"])
    assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
