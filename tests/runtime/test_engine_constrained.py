"""Constrained decoding through the engine, on each grammar backend: every output matches
its regex or validates against its schema; EOS only in a final state; bad grammars fail
their request only."""

from __future__ import annotations

import json
import os
import re
import time

import jsonschema
import pytest
from engine_helpers import assert_idle_and_intact
from server_helpers import descendants, pid_alive

from sprig.runtime import Engine


@pytest.fixture(scope="module", params=["outlines", "llguidance"])
def engine(request, tiny_llama):
    with Engine(tiny_llama, dtype="float32", check_integrity=True, grammar_compile_timeout_s=20,
                grammar_backend=request.param) as eng:
        yield eng


def sampled(engine: Engine, n: int, **params) -> list[dict]:
    prompts = [f"sample {i}: the answer is" for i in range(n)]
    base = {"max_new_tokens": 64, "temperature": 1.0}
    outs = engine.generate(prompts, [{**base, **params, "seed": i} for i in range(n)])
    assert_idle_and_intact(engine)
    return outs


@pytest.mark.parametrize(
    "pattern",
    [r"[0-9]{1,4}", r"-?(0|[1-9][0-9]{0,3})\.[0-9]{2}", r"(yes|no|maybe)", r"[a-z]{3,8}( [a-z]{2,5}){0,2}\.",
     r"x<s>y", r"x</s>y", r"x<\|end\|>y"],  # special tokens' names (the EOS and a stop among them) as text
)
def test_outputs_fully_match_their_regex(engine, pattern) -> None:
    for out in sampled(engine, 6, regex=pattern):
        assert re.fullmatch(pattern, out["text"]), (pattern, out["text"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_outputs_validate_against_their_schema(engine) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["name", "age", "tags"],
    }
    for out in sampled(engine, 5, json_schema=json.dumps(schema), max_new_tokens=120):
        jsonschema.validate(json.loads(out["text"]), schema)


def test_eos_is_allowed_only_in_a_final_state(engine) -> None:
    eos = engine.tokenizer.eos_token_id
    outs = sampled(engine, 4, regex=r"[a-z]{4}", logit_bias={eos: 50.0}, max_new_tokens=20)
    for out in outs:
        assert re.fullmatch(r"[a-z]{4}", out["text"])


def test_constrained_and_free_requests_share_a_batch(engine) -> None:
    params = [{"max_new_tokens": 8, "regex": r"(red|green|blue)"}, {"max_new_tokens": 8, "ignore_eos": True}]
    outs = engine.generate(["color:", "text:"], params)
    assert outs[0]["text"] in ("red", "green", "blue")
    assert outs[1]["meta_info"]["completion_tokens"] == 8
    assert_idle_and_intact(engine)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"regex": r"(?=x)y"}, "lookahead"),
        ({"json_schema": json.dumps({"type": "integer", "multipleOf": 3})}, "multipleOf"),
    ],
)
def test_an_invalid_grammar_fails_only_its_request(engine, params, message) -> None:
    outs = engine.generate(["bad", "good"], [params, {"max_new_tokens": 3, "ignore_eos": True}])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400 and message in reason["message"]
    assert outs[1]["meta_info"]["completion_tokens"] == 3
    assert_idle_and_intact(engine)


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_jump_forward_takes_a_special_tokens_name_as_text(tiny_llama, backend) -> None:
    """Forced text spelling special tokens' names (`<s>`, the EOS `</s>`) is jumped over as
    text, as the grammar reads it (tokenized with the names as specials, the grammar
    refused the jump whole and every token was sampled): the same text as without
    jump-forward, in fewer steps."""
    regex = r"(ab|cd)xy<s>z</s>w"
    params = {"max_new_tokens": 40, "temperature": 1.0, "regex": regex, "seed": 3}
    texts, jumped, steps = {}, {}, {}
    for jump in (True, False):
        with Engine(tiny_llama, dtype="float32", check_integrity=True, enable_jump_forward=jump,
                    grammar_backend=backend) as eng:
            out = eng.generate("spell:", params)
            texts[jump], jumped[jump], steps[jump] = out["text"], out["meta_info"]["jump_forward_tokens"], eng.scheduler.stats.steps
            assert_idle_and_intact(eng)
    assert re.fullmatch(regex, texts[True]) and texts[True] == texts[False]
    assert jumped[True] > 0 and jumped[False] == 0 and steps[True] < steps[False]


def test_jump_forward_appends_forced_text_in_fewer_steps(tiny_llama) -> None:
    schema = json.dumps(
        {"type": "object", "properties": {"first_name": {"enum": ["ann", "bob"]}, "score": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["first_name", "score"]}
    )
    params = [{"max_new_tokens": 40, "temperature": 1.0, "json_schema": schema, "seed": i} for i in range(4)]
    steps = {}
    for jump in (True, False):
        with Engine(tiny_llama, dtype="float32", check_integrity=True, enable_jump_forward=jump) as eng:
            outs = eng.generate(["record:"] * 4, params)
            for out in outs:
                record = json.loads(out["text"])
                assert record["first_name"] in ("ann", "bob") and isinstance(record["score"], int)
            stats = eng.scheduler.stats
            steps[jump] = stats.steps
            assert (stats.jump_forward_tokens > 0) == jump
            assert sum(o["meta_info"]["jump_forward_tokens"] for o in outs) == stats.jump_forward_tokens
            assert_idle_and_intact(eng)
    assert steps[True] < steps[False]


def test_shutdown_stops_the_grammar_compile_workers(tiny_llama) -> None:
    """A compile runs in a worker process that the engine keeps for the next compile;
    `shutdown` (the end of a `with` block) stops it."""
    before = descendants(os.getpid())
    with Engine(tiny_llama, dtype="float32") as eng:
        assert re.fullmatch("[0-9]+", eng.generate("n:", {"max_new_tokens": 6, "regex": "[0-9]+"})["text"])
        workers = descendants(os.getpid()) - before
        assert workers
    deadline = time.monotonic() + 10
    while alive := [pid for pid in workers if pid_alive(pid)]:
        assert time.monotonic() < deadline, f"compile workers outlived the engine: {alive}"
        time.sleep(0.05)
