"""A constraint deferred past the reasoning (`reasoning_start` / `reasoning_end`, and the
stop tokens that may end the reasoning, `reasoning_exits`): the gate's phases, masks and
rollback over a real grammar, and the engine on a scripted thinking model
(tests/runtime/scripted_checkpoint.py), alone and batched."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from scripted_checkpoint import build_thinking_checkpoint
from transformers import AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.constrained import GrammarSpec, OutlinesBackend, bitmask_width
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler.reasoning_gate import Markers, Phase, ReasoningGate
from sprig.runtime.wire import decode, encode

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
THINK = {"reasoning_start": "<think>", "reasoning_end": "</think>"}
GREEDY = {"max_new_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def tok(model: Path):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def backend(tok) -> OutlinesBackend:
    return OutlinesBackend.from_tokenizer(tok)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed(grammar, tok) -> set[int]:
    row = torch.zeros(bitmask_width(len(tok)), dtype=torch.int32)
    grammar.fill_bitmask(row)
    return {t for t in range(len(tok)) if int(row[t // 32]) >> (t % 32) & 1}


def gate(tok, backend: OutlinesBackend, spec: GrammarSpec, start: str | None, end: str, exits: tuple[str, ...] = (),
         stops: frozenset[int] | None = None) -> ReasoningGate:
    stops = frozenset({tok.eos_token_id}) if stops is None else stops
    inner = backend.matcher(backend.compile(spec), stop_token_ids=stops)
    return ReasoningGate(inner, Markers.build(tok, start, end, exits), opens_inside=start is None, stop_token_ids=stops,
                         tokenizer=tok)


def test_phases_masks_and_rollback(tok, backend: OutlinesBackend) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    g = gate(tok, backend, spec, "<think>", "</think>")
    fresh = backend.matcher(backend.compile(spec), stop_token_ids={tok.eos_token_id})
    think, end, eos = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>"), tok.eos_token_id
    # start: the grammar's tokens, or the start marker
    assert g.phase is Phase.START and allowed(g, tok) == allowed(fresh, tok) | {think}
    assert g.forced_continuation() is None and not g.is_terminated()
    reasoning = [think, *ids(tok, " alpha beta"), end]
    assert g.accept_tokens(reasoning[:-1]) and g.phase is Phase.THINKING
    # thinking: anything but a stop token; a stop token is refused
    assert allowed(g, tok) == set(range(len(tok))) - {eos}
    assert not g.accept_token(eos) and g.phase is Phase.THINKING
    assert g.accept_token(end) and g.phase is Phase.ANSWER
    assert allowed(g, tok) == allowed(fresh, tok) and g.forced_continuation() == fresh.forced_continuation()
    answer = ids(tok, '{"city":"Rome"}')
    assert g.accept_tokens(answer) and g.is_terminated()
    # rollback crosses phases and restores each exactly
    assert g.rollback(len(answer) + 1) == [end, *answer] and g.phase is Phase.THINKING
    assert g.rollback(len(reasoning) - 1) == reasoning[:-1] and g.phase is Phase.START
    assert g.accept_tokens([*reasoning, *answer]) and g.is_finished() is fresh.accept_tokens(answer) is True
    # a token the grammar refuses at the start is refused, state unchanged
    h = gate(tok, backend, spec, "<think>", "</think>")
    assert not h.accept_token(ids(tok, " gamma")[0]) and h.phase is Phase.START


def test_a_text_marker_may_span_tokens_and_leave_text_for_the_grammar(tok, backend: OutlinesBackend) -> None:
    g = gate(tok, backend, GrammarSpec.json_schema(SCHEMA), None, "alpha beta")
    assert g.phase is Phase.THINKING and g.accept_tokens(ids(tok, "x alpha"))
    assert g.phase is Phase.THINKING and g.accept_token(ids(tok, " beta")[0]) and g.phase is Phase.ANSWER
    # the marker ends inside a token: its rest goes to the grammar, which may refuse it
    regex = gate(tok, backend, GrammarSpec.regex("a[0-9]+"), None, "alph")
    assert regex.accept_token(ids(tok, " alpha")[0]) and regex.phase is Phase.ANSWER
    assert allowed(regex, tok) and not regex.is_terminated()  # "a" taken: a digit is owed
    refused = gate(tok, backend, GrammarSpec.json_schema(SCHEMA), None, "alph")
    assert not refused.accept_token(ids(tok, " alpha")[0]) and refused.phase is Phase.THINKING


def test_a_token_completing_a_text_marker_with_refused_text_is_masked_out(tok, backend: OutlinesBackend) -> None:
    """Found by the fuzzer: with a plain-text marker a token could complete it and run on
    into text the grammar refuses; the mask allowed it, so the request aborted ("the
    grammar refused sampled token")."""
    digits = gate(tok, backend, GrammarSpec.regex("[0-9]+"), None, "alpha b")
    assert digits.accept_tokens(ids(tok, "x alpha"))
    beta = ids(tok, " beta")[0]
    assert beta not in allowed(digits, tok) and not digits.accept_token(beta) and digits.phase is Phase.THINKING
    assert ids(tok, " b")[0] in allowed(digits, tok)  # completing it exactly leaves nothing to refuse
    assert digits.accept_token(ids(tok, " b")[0]) and digits.phase is Phase.ANSWER
    # leading blanks after the marker are dropped, not refused
    spaced = gate(tok, backend, GrammarSpec.regex("[0-9]+"), None, "alph")
    assert spaced.accept_tokens(ids(tok, "x alph"[:-1])) and ids(tok, "a ")[0] in allowed(spaced, tok)


@pytest.mark.parametrize("end", ["alpha b", "a b", "</think>", "e", "<|end|> al", "d|> x"])
def test_the_thinking_mask_allows_exactly_what_is_accepted(tok, backend: OutlinesBackend, end: str) -> None:
    """Against brute force over the whole vocabulary, after each prefix of a script that
    holds a special token (written as its name while the marker is looked for)."""
    g = gate(tok, backend, GrammarSpec.regex("[0-9]+"), None, end)
    script = [*ids(tok, "x"), tok.convert_tokens_to_ids("<|end|>"), *ids(tok, " alpha")]
    for n in range(len(script) + 1):
        g.rollback(len(g._history))
        if not g.accept_tokens(script[:n]):
            break
        mask = allowed(g, tok)
        for t in range(len(tok)):
            took = g.accept_token(t)
            assert took == (t in mask), (end, n, t, tok.decode([t]))
            if took:
                g.rollback(1)
    assert n >= 2


def test_the_engine_never_writes_a_token_that_overruns_a_plain_marker(model: Path, tok) -> None:
    """The script writes " alpha beta": " beta" would complete "alpha b" with "eta", which
    digits refuse. Greedy output takes the next best token instead (it aborted before the
    mask refused " beta"); the marker, if written, is followed by digits."""
    prompt = ids(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=False))
    params = {**GREEDY, "max_new_tokens": 12, "regex": "[0-9]+", "reasoning_start": "<think>",
              "reasoning_end": "alpha b"}
    with Engine(model, dtype="float32") as engine:
        outs = engine.generate(input_ids=[prompt] * 2, sampling_params=[params, {**params, "temperature": 1.0,
                                                                                 "seed": 3}])
        engine.check_integrity()
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] in ("length", "stop"), out["meta_info"]["finish_reason"]
        assert out["text"].startswith("<think> alpha") and "alpha beta" not in out["text"], out["text"]
        _, marker, answer = out["text"].partition("alpha b")
        assert not marker or re.fullmatch("[0-9]*", answer), out["text"]


def test_an_exit_ends_the_reasoning_and_no_other_stop_token_does(tok, backend: OutlinesBackend) -> None:
    """`<s>` stands for harmony's `<|call|>`: a stop token that may end the output while
    thinking; the EOS stays forbidden there, and after the end marker the grammar holds."""
    spec = GrammarSpec.json_schema(SCHEMA)
    call, eos, end = tok.bos_token_id, tok.eos_token_id, tok.convert_tokens_to_ids("</think>")
    stops = frozenset({eos, call})
    fresh = backend.matcher(backend.compile(spec), stop_token_ids=stops)
    g = gate(tok, backend, spec, None, "</think>", ("<s>",), stops)
    assert g.markers.exit_ids == {call} and g.phase is Phase.THINKING
    reasoning = ids(tok, " alpha beta")
    assert g.accept_tokens(reasoning)
    assert allowed(g, tok) == set(range(len(tok))) - {eos}  # the exit allowed, the other stop token not
    assert not g.accept_token(eos) and g.phase is Phase.THINKING and not g.is_terminated()
    assert g.accept_token(call) and g.phase is Phase.EXITED and g.is_terminated() and g.is_finished()
    assert allowed(g, tok) == set() and not g.accept_token(ids(tok, " gamma")[0]) and g.forced_continuation() is None
    # rollback across the exit: thinking again, with the same mask
    assert g.rollback(1) == [call] and g.phase is Phase.THINKING and not g.is_finished()
    assert allowed(g, tok) == set(range(len(tok))) - {eos}
    # past the end marker the grammar holds, the exit no more allowed than the grammar allows it
    assert g.accept_token(end) and g.phase is Phase.ANSWER and allowed(g, tok) == allowed(fresh, tok)
    assert call not in allowed(g, tok) and not g.accept_token(call) and g.phase is Phase.ANSWER
    answer = ids(tok, '{"city":"Paris"}')
    assert g.accept_tokens(answer) and g.is_terminated() and g.accept_token(call) and g.is_finished()
    assert g.rollback(len(answer) + 2) == [end, *answer, call] and g.phase is Phase.THINKING


def test_an_exit_is_a_stop_token_spelled_by_one_token(tok, backend: OutlinesBackend) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    assert Markers.build(tok, None, "</think>", ("alpha beta", "<s>")).exit_ids == {tok.bos_token_id}
    ordinary = gate(tok, backend, spec, None, "</think>", ("<s>",))  # <s> is no stop token of this request
    assert ordinary.accept_token(tok.bos_token_id) and ordinary.phase is Phase.THINKING
    assert not ordinary.is_terminated()
    without = gate(tok, backend, spec, None, "</think>", (), frozenset({tok.eos_token_id, tok.bos_token_id}))
    assert tok.bos_token_id not in allowed(without, tok) and not without.accept_token(tok.bos_token_id)


def test_the_engine_constrains_only_the_answer(model: Path, tok) -> None:
    prompt = ids(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=False))
    schema = {**GREEDY, "json_schema": SCHEMA}
    with Engine(model, dtype="float32") as engine:
        def run(*params: dict) -> list[str]:
            outs = engine.generate(input_ids=[prompt] * len(params), sampling_params=list(params))
            return [o["text"] for o in outs]

        [free] = run(GREEDY)
        assert free == "<think> alpha beta</think> gamma"  # the script, unconstrained
        [deferred] = run({**schema, **THINK})
        assert deferred.startswith("<think> alpha beta</think>")
        jsonschema.validate(json.loads(deferred.removeprefix("<think> alpha beta</think>")), SCHEMA)
        [at_once] = run(schema)  # without the gate the grammar forbids <think> from the start
        jsonschema.validate(json.loads(at_once), SCHEMA)
        [inside] = run({**schema, "reasoning_end": "</think>"})  # the output starts inside the reasoning
        assert inside == deferred
        # </think> a stop token: forbidden while thinking, unless an exit, which ends the output there
        end = tok.convert_tokens_to_ids("</think>")
        stopped = {**schema, **THINK, "reasoning_end": " gamma", "stop_token_ids": [end], "no_stop_trim": True}
        [exited] = engine.generate(input_ids=[prompt], sampling_params=[{**stopped, "reasoning_exits": ["</think>"]}])
        assert exited["text"] == "<think> alpha beta</think>"
        assert exited["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}
        [kept_on] = run(stopped)
        assert not kept_on.startswith("<think> alpha beta</think>")
        # batched with unconstrained and undeferred requests, each output is what it is alone
        seeded = {**schema, **THINK, "temperature": 1.0, "seed": 7}
        [alone_seeded] = run(seeded)
        assert run(GREEDY, {**schema, **THINK}, schema, seeded) == [free, deferred, at_once, alone_seeded]


def test_marker_parameters_are_validated() -> None:
    params = SamplingParams.from_dict({"regex": "a", **THINK, "reasoning_exits": ["<|call|>", "<|call|>"]})
    assert decode(encode(params)) == params and params.reasoning_exits == ("<|call|>",)
    for bad, needle in [({"reasoning_start": "<think>"}, "needs reasoning_end"), ({"reasoning_end": ""}, "reasoning_end"),
                        ({"reasoning_end": "x" * 65}, "reasoning_end"), ({"reasoning_end": 3}, "reasoning_end"),
                        ({"reasoning_exits": ["<|call|>"]}, "reasoning_exits needs reasoning_end"),
                        ({**THINK, "reasoning_exits": "<|call|>"}, "reasoning_exits"),
                        ({**THINK, "reasoning_exits": [""]}, "reasoning_exits"),
                        ({**THINK, "reasoning_exits": ["x"] * 9}, "reasoning_exits")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams.from_dict(bad)
