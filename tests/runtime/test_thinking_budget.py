"""Thinking budgets (`SamplingParams.thinking_budget`): the reasoning gate closes the
reasoning after that many tokens by writing its end marker, and the answer follows.

Checked: the gate's phases, masks and rollback (a special-token marker, a plain-text
marker of several tokens, a character cut across byte tokens); the engine against
transformers (the budgeted output is the free output's first tokens, the end marker,
then transformers' greedy continuation of that), batched with other budgets or none;
seeded sampling unchanged until the budget closes; and the scripted thinking model with
and without a constraint."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_helpers import assert_idle_and_intact, make_prompts
from scripted_checkpoint import build_thinking_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.constrained import FreeGrammar, GrammarSpec, OutlinesBackend, bitmask_width
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler.reasoning_gate import CHARACTER_WAIT, Markers, Phase, ReasoningGate
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
THINK = {"reasoning_start": "<think>", "reasoning_end": "</think>"}
GREEDY = {"max_new_tokens": 40, "temperature": 0}
TEXT_END = " Answer:"  # a plain-text end marker of several tokens


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_checkpoint(tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def tok(scripted: Path):
    return AutoTokenizer.from_pretrained(scripted)


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed(grammar, tok) -> set[int]:
    row = torch.zeros(bitmask_width(len(tok)), dtype=torch.int32)
    grammar.fill_bitmask(row)
    return {t for t in range(len(tok)) if int(row[t // 32]) >> (t % 32) & 1}


def free_gate(tok, start: str | None, end: str, budget: int | None) -> ReasoningGate:
    return ReasoningGate(FreeGrammar(), Markers.build(tok, start, end), opens_inside=start is None,
                         stop_token_ids=(), tokenizer=tok, budget=budget)


def test_a_spent_budget_writes_the_end_marker_then_the_answer_is_free(tok) -> None:
    every = set(range(len(tok)))
    think, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    g = free_gate(tok, "<think>", "</think>", 2)
    assert g.phase is Phase.START and allowed(g, tok) == every
    assert g.accept_token(think) and g.phase is Phase.THINKING  # the start marker is not counted
    alpha, beta = ids(tok, " alpha beta")
    assert g.accept_token(alpha) and g.phase is Phase.THINKING and allowed(g, tok) == every  # a stop token too
    assert g.accept_token(beta) and g.phase is Phase.CLOSING and allowed(g, tok) == {end}
    assert not g.accept_token(alpha) and g.phase is Phase.CLOSING
    assert g.accept_token(end) and g.phase is Phase.ANSWER and allowed(g, tok) == every
    assert g.accept_token(tok.eos_token_id) and not g.is_finished()  # the stop checks end the output, not the gate
    # rollback restores the count and the closing exactly
    assert g.rollback(2) == [end, tok.eos_token_id] and g.phase is Phase.CLOSING and allowed(g, tok) == {end}
    assert g.rollback(2) == [alpha, beta] and g.phase is Phase.THINKING
    assert g.accept_token(alpha) and g.phase is Phase.THINKING


def test_the_mask_is_skipped_only_where_it_would_allow_every_token(tok) -> None:
    """`allows_all` (the scheduler then skips the row's mask and the logits copy) is true
    while a budget alone thinks and once it answers, never while it closes, nor while
    stop tokens are held back: wherever it is true the mask would allow every token."""
    every = set(range(len(tok)))
    end, stop = tok.convert_tokens_to_ids("</think>"), tok.eos_token_id
    free = free_gate(tok, None, "</think>", 2)
    held = ReasoningGate(FreeGrammar(), Markers.build(tok, None, "</think>"), opens_inside=True,
                         stop_token_ids=(stop,), tokenizer=tok, budget=2)
    seen = []
    for token in [*ids(tok, " alpha beta"), end, *ids(tok, " gamma")]:
        for g in (free, held):
            assert not g.allows_all() or allowed(g, tok) == every
        seen.append((free.phase, free.allows_all(), held.allows_all()))
        assert free.accept_token(token) and held.accept_token(token)
    assert seen == [(Phase.THINKING, True, False), (Phase.THINKING, True, False), (Phase.CLOSING, False, False),
                    (Phase.ANSWER, True, True)]


def test_a_natural_end_before_the_budget_changes_nothing(tok) -> None:
    g = free_gate(tok, None, "</think>", 5)
    assert g.accept_tokens([*ids(tok, " alpha"), tok.convert_tokens_to_ids("</think>")]) and g.phase is Phase.ANSWER
    assert g.accept_tokens(ids(tok, " alpha beta gamma delta epsilon")) and g.phase is Phase.ANSWER


def test_a_budget_of_zero_closes_at_once(tok) -> None:
    end = tok.convert_tokens_to_ids("</think>")
    assert allowed(free_gate(tok, None, "</think>", 0), tok) == {end}  # the output opens inside the reasoning
    g = free_gate(tok, "<think>", "</think>", 0)
    assert g.accept_token(tok.convert_tokens_to_ids("<think>")) and allowed(g, tok) == {end}
    answered = free_gate(tok, "<think>", "</think>", 0)  # an output that answers at once is not held
    assert answered.accept_token(ids(tok, " gamma")[0]) and answered.phase is Phase.ANSWER


def test_a_plain_text_marker_is_written_token_by_token_and_the_grammar_follows(tok) -> None:
    backend = OutlinesBackend.from_tokenizer(tok)
    inner = backend.matcher(backend.compile(GrammarSpec.regex(" ?[0-9]+")), stop_token_ids={tok.eos_token_id})
    markers = Markers.build(tok, None, TEXT_END)
    assert len(markers.end_ids) > 1 and tok.decode(list(markers.end_ids)) == TEXT_END
    g = ReasoningGate(inner, markers, opens_inside=True, stop_token_ids={tok.eos_token_id}, tokenizer=tok, budget=3)
    assert g.accept_tokens(ids(tok, " one two three")) and g.phase is Phase.CLOSING
    for i, token in enumerate(markers.end_ids):
        assert allowed(g, tok) == {token}, i
        assert g.accept_token(token)
    assert g.phase is Phase.ANSWER and tok.eos_token_id not in allowed(g, tok)  # the grammar holds now
    assert g.accept_tokens(ids(tok, " 42")) and g.is_terminated()
    assert g.rollback(len(ids(tok, " 42")) + 1) == [markers.end_ids[-1], *ids(tok, " 42")]
    assert g.phase is Phase.CLOSING and allowed(g, tok) == {markers.end_ids[-1]}


def test_the_budget_waits_for_a_character_cut_across_tokens(tok) -> None:
    """A character of several bytes written by byte tokens: the budget, spent on its
    first byte, closes only once the character is whole, and waits at most
    `CHARACTER_WAIT` tokens for one."""
    pieces = ids(tok, "日")
    assert 1 < len(pieces) <= 1 + CHARACTER_WAIT and tok.decode(pieces[:1]).endswith("\ufffd")
    g = free_gate(tok, None, "</think>", 1)
    for k, token in enumerate(pieces[:-1]):
        assert g.accept_token(token) and g.phase is Phase.THINKING, k
    assert g.accept_token(pieces[-1]) and g.phase is Phase.CLOSING
    broken = free_gate(tok, None, "</think>", 1)  # lead bytes that no character ever completes
    assert broken.accept_tokens([pieces[0]] * CHARACTER_WAIT) and broken.phase is Phase.THINKING
    assert broken.accept_token(pieces[0]) and broken.phase is Phase.CLOSING


def test_params_need_an_end_marker_and_a_count() -> None:
    with pytest.raises(ValueError, match="thinking_budget needs reasoning_end"):
        SamplingParams(thinking_budget=3)
    with pytest.raises(ValueError, match="thinking_budget must be >= 0"):
        SamplingParams(thinking_budget=-1, reasoning_end="</think>")
    with pytest.raises(ValueError, match="thinking_budget must be >= 0"):
        SamplingParams(thinking_budget="3", reasoning_end="</think>")
    assert SamplingParams(thinking_budget=2.0, reasoning_end="</think>").thinking_budget == 2


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def _closes_at(tok, free: list[int], budget: int) -> int:
    """How many free tokens the reasoning keeps: the budget, held while the text ends
    inside a character (at most `CHARACTER_WAIT` more)."""
    at = budget
    while at < budget + CHARACTER_WAIT and at and tok.decode(free[max(0, at - 4) : at]).endswith("\ufffd"):
        at += 1
    return at


def test_budgeted_greedy_outputs_equal_transformers_alone_and_batched(random_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(random_model)
    hf = AutoModelForCausalLM.from_pretrained(random_model, dtype=torch.float32).eval()
    end_ids = ids(tok, TEXT_END)
    n = 14
    prompts = [tok.encode(p) for p in make_prompts(4, seed=5)]
    budgets = [0, 2, 5, None]
    base = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, "reasoning_end": TEXT_END}
    want = []
    for prompt, budget in zip(prompts, budgets, strict=True):
        free = _hf_greedy(hf, prompt, n)
        assert TEXT_END not in tok.decode(free)  # the random model never ends its reasoning itself
        if budget is None:
            want.append(free)
            continue
        kept = free[: _closes_at(tok, free, budget)]
        head = kept + end_ids
        want.append((head + _hf_greedy(hf, prompt + head, n - len(head)))[:n])
    params = [{**base, "thinking_budget": b} if b is not None else base for b in budgets]
    with Engine(random_model, dtype="float32", max_running_requests=8) as engine:
        batched = engine.generate(input_ids=prompts, sampling_params=params)
        alone = [engine.generate(input_ids=[p], sampling_params=[s])[0] for p, s in zip(prompts, params, strict=True)]
        assert_idle_and_intact(engine)
    for i, (b, a, w) in enumerate(zip(batched, alone, want, strict=True)):
        assert a["output_ids"] == w, (i, budgets[i])
        assert b["output_ids"] == w, (i, budgets[i])
        if budgets[i] is not None:
            assert TEXT_END in tok.decode(w)


def test_seeded_sampling_is_unchanged_until_the_budget_closes(random_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(random_model)
    prompt = tok.encode(make_prompts(1, seed=9)[0])
    base = {"max_new_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True, "reasoning_end": TEXT_END}
    with Engine(random_model, dtype="float32") as engine:
        free, budgeted = engine.generate(input_ids=[prompt, prompt],
                                         sampling_params=[base, {**base, "thinking_budget": 6}])
        assert_idle_and_intact(engine)
    kept = _closes_at(tok, free["output_ids"], 6)
    assert budgeted["output_ids"][:kept] == free["output_ids"][:kept]
    assert budgeted["output_ids"][kept : kept + len(ids(tok, TEXT_END))] == ids(tok, TEXT_END)


def test_the_scripted_model_thinks_within_its_budget(scripted: Path, tok) -> None:
    """The script writes `<think> alpha beta</think> gamma`; a budget of one closes it
    after " alpha", and the answer follows, free or held to a schema."""
    prompt = ids(tok, tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=False))
    opened = prompt + ids(tok, "<think>")
    with Engine(scripted, dtype="float32") as engine:
        def run(prompt_ids: list[int], **params) -> str:
            return engine.generate(input_ids=[prompt_ids], sampling_params=[{**GREEDY, **params}])[0]["text"]

        assert run(prompt, **THINK, thinking_budget=5) == "<think> alpha beta</think> gamma"
        assert run(prompt, **THINK, thinking_budget=1) == "<think> alpha</think> gamma"
        assert run(prompt, **THINK, thinking_budget=0) == "<think></think> gamma"
        assert run(opened, reasoning_end="</think>", thinking_budget=1) == " alpha</think> gamma"
        held = run(prompt, **THINK, thinking_budget=1, json_schema=SCHEMA)
        head, _, answer = held.partition("</think>")
        assert head == "<think> alpha"
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert_idle_and_intact(engine)
