"""Harmony (gpt-oss) outputs read as OpenAI's assistant message, whole and streamed.

The expected readings follow OpenAI's harmony spec as vLLM and SGLang read it: the analysis
channel is the reasoning, the final channel and commentary without a recipient are the
content (bodies of one kind joined with newlines, as vLLM joins them), and a message to
`functions.NAME` is a call whose arguments are its body. Streamed in any pieces (single
characters, or as a tokenizer cuts it: every marker one token), the deltas only append
and add up to the whole reading, and no marker, nor the start of one, reaches a client."""

from __future__ import annotations

import json
import re

import pytest

from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.harmony import MARKERS, HarmonyReader, opening
from sprig.runtime.server.reasoning import Phase

NAMES = frozenset({"get_weather", "get_time"})
ARGS = '{"location": "Tokyo", "note": "a } and <| inside"}'
CALL_AT = "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"

# output (after the generation prompt `<|start|>assistant`), then (reasoning, content, [(name, args, complete)])
CASES = {
    "answer": (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
               ("The user wants the weather.", "It is sunny.", [])),
    "answer, stop token trimmed": (THINK + "<|start|>assistant<|channel|>final<|message|>It is sunny.",
                                   ("The user wants the weather.", "It is sunny.", [])),
    "call, channel first": (
        THINK + f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
                "<|call|>",
        ("The user wants the weather.", "", [("get_weather", ARGS, True)])),
    "call, recipient first": (
        THINK + f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>",
        ("The user wants the weather.", "", [("get_weather", ARGS, True)])),
    "call, recipient first, no analysis": (
        f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>", (None, "", [
            ("get_weather", ARGS, True)])),
    "call, no content type": ("<|channel|>commentary to=functions.get_time<|message|>{}<|call|>",
                              (None, "", [("get_time", "{}", True)])),
    "preamble, then several calls": (
        THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
                f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
                "<|call|><|start|>assistant<|channel|>analysis<|message|>Now the time.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
        ("The user wants the weather.\nNow the time.", "Checking both.",
         [("get_weather", ARGS, True), ("get_time", "{}", True)])),
    "an unknown function is content": (
        "<|channel|>commentary to=functions.delete_files <|constrain|>json<|message|>{\"all\": true}<|call|>",
        (None, '{"all": true}', [])),
    "a built-in tool in the analysis is reasoning": (
        "<|channel|>analysis to=browser.search code<|message|>{\"query\": \"weather\"}<|call|>",
        ('{"query": "weather"}', "", [])),
    "no end marker before the next header": (
        "<|channel|>analysis<|message|>short<|channel|>final<|message|>done<|return|>", ("short", "done", [])),
    "end of text": (THINK + "<|start|>assistant<|channel|>final<|message|>x<|endoftext|>",
                    ("The user wants the weather.", "x", [])),
    "cut mid-analysis": ("<|channel|>analysis<|message|>The user wa", ("The user wa", "", [])),
    "cut mid-header": (THINK + "<|start|>assistant<|channel|>fin", ("The user wants the weather.", "", [])),
    "cut mid-final": (THINK + "<|start|>assistant<|channel|>final<|message|>It is", (
        "The user wants the weather.", "It is", [])),
    "cut mid-call": (THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                             '<|message|>{"location": "To',
                     ("The user wants the weather.", "", [("get_weather", '{"location": "To', False)])),
    "no harmony at all": ("Plain text, <b>bold</b>.", (None, "Plain text, <b>bold</b>.", [])),
}


def pieces(text: str, how: str) -> list[str]:
    """`text` cut as it may arrive: single characters, or tokens (every marker whole)."""
    if how == "chars":
        return list(text)
    out = []
    for part in re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", text):
        out += [part] if part in MARKERS else re.findall(r"\s*[^\s]{1,3}|\s+", part)
    return out


def streamed(fmt: AnswerFormat, parts: list[str]) -> tuple[dict, bool]:
    """The deltas of `parts` joined back into a message, and the last delta's `called`."""
    state, called = DeltaState(), False
    reasoning, content, calls = "", "", {}
    for i, part in enumerate(parts):
        body, called = state.delta(fmt, part, i == len(parts) - 1)
        for key in ("reasoning_content", "content"):
            assert not re.search(r"<\|?$|<\|[a-z]", body.get(key, "").replace("<| inside", "")), body
        reasoning += body.get("reasoning_content", "")
        content += body.get("content", "")
        for piece in body.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["id"].startswith("call_")
                calls[piece["index"]] = [piece["function"]["name"], ""]
            calls[piece["index"]][1] += piece["function"]["arguments"]
    return {"reasoning": reasoning, "content": content, "calls": [tuple(c) for c in calls.values()]}, called


def harmony(names: frozenset[str] = NAMES, split: bool = True, opened: str = "assistant", **kw) -> AnswerFormat:
    return AnswerFormat(None, Phase.ANSWER, None, names, harmony=HarmonyReader(opened, split, names), **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_reading(case: str) -> None:
    text, (reasoning, content, calls) = CASES[case]
    reading = HarmonyReader("assistant", True, NAMES).read(text, finished=True)
    assert (reading.reasoning, reading.content, reading.calls) == (reasoning, content, calls)
    message, called = harmony().message(text)
    assert message["reasoning_content"] == reasoning and message["content"] == (content if content or not calls
                                                                                else None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == [
        (name, args) for name, args, _ in calls]
    assert called == (bool(calls) and all(done for *_, done in calls))


@pytest.mark.parametrize("how", ["chars", "tokens"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_reading_adds_up_to_the_whole(case: str, how: str) -> None:
    text, (reasoning, content, calls) = CASES[case]
    reader = HarmonyReader("assistant", True, NAMES)
    earlier = reader.read("", finished=False)
    for end in range(1, len(text) + 1):
        now = reader.read(text[:end], finished=False)
        assert (now.reasoning or "").startswith(earlier.reasoning or "") and now.content.startswith(earlier.content)
        assert len(now.calls) >= len(earlier.calls)
        assert all(a.startswith(b) and n == m for (n, a, _), (m, b, _) in zip(now.calls, earlier.calls, strict=False))
        earlier = now
    joined, called = streamed(harmony(), pieces(text, how))
    assert joined == {"reasoning": reasoning or "", "content": content, "calls": [c[:2] for c in calls]}
    assert called == (bool(calls) and all(done for *_, done in calls))


def test_a_marker_split_across_pieces_never_shows() -> None:
    reader = HarmonyReader("assistant", True, NAMES)
    assert reader.read("<|channel|>final<|message|>Hi <|re", finished=False).content == "Hi "
    assert reader.read("<|channel|>final<|message|>Hi <|re", finished=True).content == "Hi <|re"  # text after all
    assert reader.read("<|channel|>final<|message|>a <b> <|tag", finished=False).content == "a <b> <|tag"


def test_without_split_reasoning_the_analysis_is_content() -> None:
    text = CASES["preamble, then several calls"][0]
    message, called = harmony(split=False).message(text)
    assert "reasoning_content" not in message and called
    assert message["content"] == "The user wants the weather.\nChecking both.\nNow the time."


def test_calls_of_a_request_without_tools_are_content() -> None:
    text = CASES["call, channel first"][0]
    message, called = harmony(names=frozenset()).message(text)
    assert not called and "tool_calls" not in message and message["content"] == ARGS


def test_one_call_keeps_the_first() -> None:
    message, called = harmony(one_call=True).message(CASES["preamble, then several calls"][0])
    assert called and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize(("text", "complete"), [(ARGS, True), (ARGS + "<|call|>", True), (ARGS[:9], False)])
def test_a_call_the_prompt_opened(text: str, complete: bool) -> None:
    """A forced call: the server wrote the header into the prompt, the output is the
    arguments (the grammar stops it without `<|call|>`); cut short, they are partial."""
    fmt = harmony(opened=CALL_AT, forced=True)
    message, called = fmt.message(text)
    assert called is complete and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": ARGS[:len(
        text.removesuffix("<|call|>"))]}]
    if complete:
        json.loads(message["tool_calls"][0]["function"]["arguments"])
    joined, streamed_called = streamed(fmt, pieces(text, "chars"))
    assert joined["calls"] == [("get_weather", text.removesuffix("<|call|>"))] and streamed_called is complete


def test_a_continued_final_message() -> None:
    fmt = harmony(opened="assistant<|channel|>final<|message|>")
    assert fmt.message(" and more.<|return|>")[0]["content"] == " and more."


@pytest.mark.parametrize(("prompt", "expected"), [
    ("<|start|>user<|message|>hi<|end|><|start|>assistant", "assistant"),
    ("<|start|>assistant<|channel|>final<|message|>The answer is", "assistant<|channel|>final<|message|>"),
    ("<|start|>user<|message|>hi<|end|>", ""),
    ("<|start|>assistant<|channel|>final<|message|>4<|return|>", ""),
    ("no harmony here", ""),
])
def test_opening_is_what_the_prompt_leaves_open(prompt: str, expected: str) -> None:
    assert opening(prompt) == expected
