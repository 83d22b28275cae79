"""`stop_regex`: the pattern matcher on a growing text (against a brute-force reference
over random chunkings), and the Engine ending requests at a match, trimmed or kept,
streamed or not, alone or batched — with the KV invariant checked after each."""

from __future__ import annotations

import itertools
import re

import pytest
from engine_helpers import assert_idle_and_intact
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.runtime import Engine
from sprig.runtime.detokenizer import StopMatcher
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.stop_regex import MAX_PATTERN_CHARS, MAX_PATTERNS, WINDOW_CHARS, StopPatterns
from sprig.runtime.wire import decode, encode

PROMPT = "the quick fox and the lazy dog"
PIECES = ["a", "b", "ab", "b+", "a.b", "(ab|b)", "[ab]c", "b{2}", "c$", r"\bb", "a+?c", "(?<=a)b", "a|bc"]


def _cut(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[i:j] for i, j in itertools.pairwise(bounds)]


def _first_push_match(pieces: list[str], patterns: list[str]) -> tuple[int, re.Match | None, int]:
    """Brute force: the first push whose text so far `re`-matches some pattern (the one
    ending first, then starting first, then listed first), and that text's length."""
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        found = [m for p in patterns if (m := re.compile(p).search(text, max(0, len(text) - WINDOW_CHARS)))]
        if found:
            return k, min(found, key=lambda m: (m.end(), m.start())), len(text)
    return len(pieces), None, len(text)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text("abc ", max_size=40),
    patterns=st.lists(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join),
                      min_size=1, max_size=3, unique=True),
    cuts=st.lists(st.integers(0, 60), max_size=10),
    no_trim=st.booleans(),
)
def test_streamed_text_is_the_text_up_to_the_match_and_never_retracted(text, patterns, cuts, no_trim):
    pieces = _cut(text, cuts)
    k, match, length = _first_push_match(pieces, patterns)
    matcher = StopMatcher((), no_trim, tuple(patterns))
    shown = [matcher.push(p) for p in pieces[: k + 1]] + [matcher.push("", final=True)]
    visible = "".join(s for s, _ in shown)
    whole = "".join(pieces[: k + 1])
    if match is None:
        assert visible == whole and matcher.matched is None
        return
    assert visible == whole[: match.end() if no_trim else match.start()]
    assert matcher.matched == match.re.pattern and [m for _, m in shown if m] == [match.re.pattern]
    alone = StopMatcher((), no_trim, tuple(patterns)).push(whole, final=True)  # one push, same cut
    assert alone == (visible, match.re.pattern) and length == len(whole)


def test_partial_match_is_held_back_until_it_fails():
    matcher = StopMatcher((), False, (r"Answer: \d+\.",))
    assert matcher.push("The Ans") == ("The ", None)  # "Ans" could begin a match
    assert matcher.push("wer: 4") == ("", None)
    assert matcher.push("x and") == ("Answer: 4x and", None)  # "4x" rules it out
    assert matcher.push(" Answer: 12. tail") == (" ", r"Answer: \d+\.")


def test_search_window_is_bounded():
    matcher = StopMatcher((), False, (r"start.*end",))
    gap = "start" + "x" * (WINDOW_CHARS - 10)
    assert matcher.push(gap) == ("", None)  # a partial match from "start": all held
    assert matcher.push("x" * 20) == (gap + "x" * 20, None)  # "start" left the window
    assert matcher.push("end") == ("end", None)  # and can no longer begin a match
    assert StopPatterns(["a"]).first_match("a" + "b" * WINDOW_CHARS) is None


def test_catastrophic_pattern_ends_the_text_with_an_error():
    matcher = StopMatcher((), False, (r"(.*?,){30}P",))
    text = "a," * 100
    assert matcher.push(text) == (text, None)
    assert "took more than" in matcher.error and matcher.push("more") == ("", None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("(", "does not compile"),
        ("a*", "matches the empty string"),
        (["x"] * (MAX_PATTERNS + 1), "at most"),
        ("x" * (MAX_PATTERN_CHARS + 1), "at most"),
        ([""], "non-empty"),
        (5, "non-empty"),
    ],
)
def test_bad_patterns_are_refused_naming_stop_regex(value, message):
    with pytest.raises(ValueError, match=f"stop_regex.*{message}"):
        SamplingParams.from_dict({"stop_regex": value})


def test_null_and_empty_list_mean_none():
    assert SamplingParams.from_dict({"stop_regex": None}).stop_regex == ()
    assert SamplingParams.from_dict({"stop_regex": []}).stop_regex == ()
    params = SamplingParams.from_dict({"stop_regex": [r"\d", r"\d", "x"]})
    assert params.stop_regex == (r"\d", "x") and decode(encode(params)) == params


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """The engine, checked idle with its KV accounting intact after each use."""
    with Engine(tiny_llama, dtype="float32", check_integrity=True) as eng:
        yield eng
        assert_idle_and_intact(eng)


def test_engine_stops_at_the_match_trimmed_or_kept(engine) -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = engine.generate(PROMPT, params)["text"]
    piece = text[4:7]
    pattern = re.escape(piece) + ".*"  # greedy: runs to the end of the text at the match
    stopped = engine.generate(PROMPT, {**params, "stop_regex": pattern})
    assert stopped["text"] == text[: text.index(piece)]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    n = len(stopped["output_ids"])
    at_match, before = (engine.generate(PROMPT, {**params, "max_new_tokens": k})["text"] for k in (n, n - 1))
    assert piece in at_match and piece not in before  # it ended on the token that completed the match
    kept = engine.generate(PROMPT, {**params, "stop_regex": [pattern], "no_stop_trim": True})
    assert kept["text"] == at_match and kept["output_ids"] == stopped["output_ids"]
    streamed = list(engine.generate(PROMPT, {**params, "stop_regex": pattern}, stream=True))
    texts = [s["text"] for s in streamed]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(texts)) and texts[-1] == stopped["text"]
    assert_idle_and_intact(engine)


def test_engine_stop_regex_is_batch_invariant(engine) -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    text = engine.generate(PROMPT, params)["text"]
    regex_params = {**params, "stop_regex": re.escape(text[6:9])}
    alone = engine.generate(PROMPT, regex_params)
    others = ["one two three", "a radix tree of", PROMPT]
    batch = engine.generate([*others, PROMPT], [params] * 3 + [regex_params])
    assert batch[-1]["output_ids"] == alone["output_ids"] and batch[-1]["text"] == alone["text"]
    assert batch[2]["text"] == text  # its neighbour without the pattern runs to length
    assert alone["meta_info"]["finish_reason"]["matched"] == regex_params["stop_regex"]
    assert_idle_and_intact(engine)
