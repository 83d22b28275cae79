"""A constraint that starts at a trigger (`constraint_trigger`): the gate's phases, masks
and rollback over a real grammar, and the engine on a scripted model
(tests/runtime/scripted_checkpoint.py, which writes "<think> alpha beta</think> gamma"),
alone, batched and under the reasoning gate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scripted_checkpoint import build_thinking_checkpoint
from tokenizers import AddedToken
from transformers import AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.constrained import GrammarSpec, OutlinesBackend, bitmask_width
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler.marker import Marker
from sprig.runtime.scheduler.trigger_gate import Phase, TriggerGate
from sprig.runtime.wire import decode, encode

GREEDY = {"max_new_tokens": 40, "temperature": 0}
FREE = "<think> alpha beta</think> gamma"  # the script, unconstrained


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


def gate(tok, backend: OutlinesBackend, regex: str, trigger: str) -> TriggerGate:
    stops = {tok.eos_token_id}
    inner = backend.matcher(backend.compile(GrammarSpec.regex(regex)), stop_token_ids=stops)
    return TriggerGate(inner, Marker.build(tok, trigger), stop_token_ids=stops, tokenizer=tok)


def test_free_until_the_trigger_then_the_grammar(tok, backend: OutlinesBackend) -> None:
    g = gate(tok, backend, r" [0-9]+\.", "</think>")
    fresh = backend.matcher(backend.compile(GrammarSpec.regex(r" [0-9]+\.")), stop_token_ids={tok.eos_token_id})
    end, eos = tok.convert_tokens_to_ids("</think>"), tok.eos_token_id
    # free: every token, a stop token too (an answer without the trigger may end anywhere)
    assert g.phase is Phase.FREE and allowed(g, tok) == set(range(len(tok)))
    assert g.is_terminated() and not g.is_finished() and g.forced_continuation() is None
    text = ids(tok, "some text")
    assert g.accept_tokens(text) and g.phase is Phase.FREE
    assert g.accept_token(end) and g.phase is Phase.CONSTRAINED
    assert allowed(g, tok) == allowed(fresh, tok) and not g.is_terminated()
    answer = ids(tok, " 42.")
    assert g.accept_tokens(answer) and g.is_terminated()
    assert not g.accept_token(ids(tok, "x")[0])  # refused, state unchanged
    assert g.accept_token(eos) and g.is_finished()
    # rollback crosses phases and restores each exactly
    assert g.rollback(len(answer) + 2) == [end, *answer, eos] and g.phase is Phase.FREE
    assert g.accept_tokens([end, *answer]) and g.is_terminated()
    assert g.rollback(len(answer) + 1 + len(text)) == [*text, end, *answer] and g.phase is Phase.FREE
    # a stop token while free ends the output
    assert g.accept_token(eos) and g.phase is Phase.STOPPED and g.is_finished() and not allowed(g, tok)
    assert not g.accept_token(text[0]) and g.rollback(1) == [eos] and g.phase is Phase.FREE


def test_a_trigger_may_span_tokens_and_leave_text_for_the_grammar(tok, backend: OutlinesBackend) -> None:
    g = gate(tok, backend, "[a-z]+", "alpha b")
    assert g.accept_tokens(ids(tok, "x alpha")) and g.phase is Phase.FREE
    assert g.accept_token(ids(tok, " beta")[0]) and g.phase is Phase.CONSTRAINED  # "eta" went to the grammar
    assert g.is_terminated() and g.rollback(1) == ids(tok, " beta") and g.phase is Phase.FREE
    # a token that would complete the trigger with text the grammar refuses is masked out
    digits = gate(tok, backend, "[0-9]+", "alpha b")
    assert digits.accept_tokens(ids(tok, "x alpha"))
    beta = ids(tok, " beta")[0]
    assert beta not in allowed(digits, tok) and not digits.accept_token(beta) and digits.phase is Phase.FREE
    assert ids(tok, " b")[0] in allowed(digits, tok)  # completing it exactly leaves nothing to refuse


def test_special_tokens_write_no_text(tok, backend: OutlinesBackend) -> None:
    """As the answer's text is decoded: a special token whose name holds the trigger does
    not write it (found by the fuzzer: "<|end|>" completed the trigger "e" and its "nd|>"
    went to the grammar, which refused the token the mask had allowed); one whose name is
    the trigger is the trigger."""
    end_of_turn = tok.convert_tokens_to_ids("<|end|>")
    assert end_of_turn in tok.all_special_ids and end_of_turn != tok.eos_token_id
    g = gate(tok, backend, "[0-9]+", "e")
    assert end_of_turn in allowed(g, tok) and g.accept_token(end_of_turn) and g.phase is Phase.FREE
    assert g.accept_tokens(ids(tok, " 5")) and g.phase is Phase.FREE
    named = gate(tok, backend, "[0-9]+", "<|end|>")
    assert named.accept_token(end_of_turn) and named.phase is Phase.CONSTRAINED


def test_a_trigger_that_is_an_added_special_token(tok, backend: OutlinesBackend, tmp_path: Path) -> None:
    """Llama 3's `<|python_tag|>` opens its calls: an added token flagged special that the
    special tokens map does not list. Decoding drops it, so it is the trigger by its name
    (it was read as text that never appeared: the calls were never constrained)."""
    tok.save_pretrained(tmp_path)
    tagged = AutoTokenizer.from_pretrained(tmp_path)
    tagged.add_tokens([AddedToken("<|python_tag|>", special=True, normalized=False)], special_tokens=True)
    tag = tagged.convert_tokens_to_ids("<|python_tag|>")
    assert tag not in tagged.all_special_ids
    stops = {tagged.eos_token_id}
    tagged_backend = OutlinesBackend.from_tokenizer(tagged)
    inner = tagged_backend.matcher(tagged_backend.compile(GrammarSpec.regex("[0-9]+")), stop_token_ids=stops)
    g = TriggerGate(inner, Marker.build(tagged, "<|python_tag|>"), stop_token_ids=stops, tokenizer=tagged)
    assert g.accept_tokens(ids(tagged, "some text")) and g.phase is Phase.FREE
    assert g.accept_token(tag) and g.phase is Phase.CONSTRAINED
    assert not g.accept_token(ids(tagged, "x")[0]) and g.accept_tokens(ids(tagged, "42"))


@pytest.mark.parametrize("trigger", ["alpha b", "a b", "</think>"])
def test_the_mask_allows_exactly_what_is_accepted(tok, backend: OutlinesBackend, trigger: str) -> None:
    """Against brute force over the whole vocabulary, after each prefix of the script."""
    g = gate(tok, backend, "[0-9]+", trigger)
    script = ids(tok, "x alpha")
    for n in range(len(script) + 1):
        g.rollback(len(g._history))
        assert g.accept_tokens(script[:n])
        mask = allowed(g, tok)
        for t in range(len(tok)):
            took = g.accept_token(t)
            assert took == (t in mask), (n, t, tok.decode([t]))
            if took:
                g.rollback(1)


def test_the_engine_constrains_from_the_trigger_on(model: Path, tok) -> None:
    prompt = ids(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=False))
    with Engine(model, dtype="float32") as engine:
        def run(*params: dict) -> list[str]:
            outs = engine.generate(input_ids=[prompt] * len(params), sampling_params=list(params))
            return [o["text"] for o in outs]

        assert run(GREEDY) == [FREE]
        never = {**GREEDY, "regex": "[0-9]+", "constraint_trigger": "<tool_call>"}
        assert run(never) == [FREE]  # no trigger: free, and free to end
        after = {**GREEDY, "regex": r" (Paris|Rome)", "constraint_trigger": "</think>"}
        [constrained] = run(after)
        assert constrained in ("<think> alpha beta</think> Paris", "<think> alpha beta</think> Rome")
        # in the answer after the reasoning: "</think>" ends the reasoning, then " gam" triggers
        both = {**GREEDY, "regex": "ma", "constraint_trigger": " gam", "reasoning_end": "</think>",
                "reasoning_start": "<think>"}
        assert run(both) == [FREE]
        forced = {**both, "regex": "mb"}  # " gamma" would complete the trigger with "ma": masked out
        [answer] = run(forced)
        assert answer.startswith("<think> alpha beta</think>") and "gamma" not in answer
        assert all(part.startswith("mb") for part in answer.split(" gam")[1:])
        seeded = {**after, "temperature": 1.0, "seed": 3}
        [alone_seeded] = run(seeded)
        assert run(GREEDY, after, never, forced, seeded) == [FREE, constrained, FREE, answer, alone_seeded]
        engine.scheduler.check_integrity()


def test_trigger_parameters_are_validated() -> None:
    params = SamplingParams.from_dict({"regex": "a", "constraint_trigger": "<tool_call>"})
    assert decode(encode(params)) == params
    for bad, needle in [({"constraint_trigger": "<tool_call>"}, "needs a constraint"),
                        ({"regex": "a", "constraint_trigger": ""}, "constraint_trigger"),
                        ({"regex": "a", "constraint_trigger": 3}, "constraint_trigger")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams.from_dict(bad)
