"""`select` picks what each choices method picks by brute force over the token logprobs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_backend import ScriptedBackend, default_logprob

import sprig as sgl

PREFIX = "Q:"


def brute_force(choices: list[str], logprob, prefix: str = PREFIX) -> dict[str, str]:
    """Each method's pick, computed directly from its definition."""
    cond = [[logprob(prefix + c[:i], ch) for i, ch in enumerate(c)] for c in choices]
    alone = [[0.0 if i == 0 else logprob(c[:i], ch) for i, ch in enumerate(c)] for c in choices]
    means = [sum(row) / len(row) for row in cond]
    width = max(map(len, cond))
    padded = [row + [sum(row) / len(row)] * (width - len(row)) for row in cond]
    lifts = [sum(c - u for c, u in zip(rc, ru, strict=True)) / len(rc) for rc, ru in zip(cond, alone, strict=True)]

    def first_best(scores: list) -> int:
        return max(range(len(choices)), key=lambda i: (scores[i], -i))

    return {
        "token_length_normalized": choices[first_best(means)],
        # eliminating token by token is taking the lexicographically largest padded row
        "greedy_token_selection": choices[first_best(padded)],
        "unconditional_likelihood_normalized": choices[first_best(lifts)],
    }


METHODS = {
    "token_length_normalized": sgl.token_length_normalized,
    "greedy_token_selection": sgl.greedy_token_selection,
    "unconditional_likelihood_normalized": sgl.unconditional_likelihood_normalized,
}


def run_select(choices: list[str], method, logprob=default_logprob) -> tuple[sgl.ProgramState, ScriptedBackend]:
    backend = ScriptedBackend([], logprob=logprob)

    @sgl.function
    def program(s):
        s += PREFIX + sgl.select("pick", choices=choices, choices_method=method) + "."

    return program.run(backend=backend), backend


# A model under which the three methods disagree: "ab" has the best mean, "x" the best
# first token, "abcd" gains most over its context-free likelihood.
TABLE = {("Q:", "a"): -1.0, ("Q:a", "b"): -0.2, ("Q:ab", "c"): -3.0, ("Q:abc", "d"): -0.1,
         ("Q:", "x"): -0.7, ("a", "b"): -3.0, ("ab", "c"): -6.0, ("abc", "d"): -4.0}


def table_logprob(context: str, char: str) -> float:
    return TABLE[(context, char)]


@pytest.mark.parametrize(("name", "expected"), [
    ("token_length_normalized", "ab"),
    ("greedy_token_selection", "x"),
    ("unconditional_likelihood_normalized", "abcd"),
])
def test_the_three_methods_disagree_as_defined(name: str, expected: str) -> None:
    choices = ["ab", "abcd", "x"]
    assert brute_force(choices, table_logprob)[name] == expected
    state, backend = run_select(choices, METHODS[name], table_logprob)
    assert state["pick"] == expected
    assert state.text() == f"Q:{expected}."
    (call,) = backend.calls
    assert (call.kind, call.prompt.text, call.choices) == ("score", "Q:", tuple(choices))
    meta = state.get_meta_info("pick")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.6, -1.075, -0.7])
    if name == "unconditional_likelihood_normalized":
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([0.9, 2.175, -0.7])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=4), min_size=2, max_size=5, unique=True))
def test_select_matches_brute_force_for_every_method(choices: list[str]) -> None:
    expected = brute_force(choices, default_logprob)
    for name, method in METHODS.items():
        state, _ = run_select(choices, method)
        assert state["pick"] == expected[name], name
        means = state.get_meta_info("pick")["normalized_prompt_logprobs"]
        assert all(math.isfinite(m) for m in means)


def test_gen_with_choices_is_select_and_counts_its_cost() -> None:
    backend = ScriptedBackend([], logprob=table_logprob)

    @sgl.function
    def program(s):
        s += "Q:" + sgl.gen("pick", choices=["ab", "x"])

    state = program.run(backend=backend)
    assert state["pick"] == "ab"
    assert state.cost().calls == 1 and state.cost().prompt_tokens == len("Q:ab") + len("Q:x")


def test_select_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("x", choices=["a"], temperature=0.5)
