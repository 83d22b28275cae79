"""A chat answer as a message and as stream deltas: a forced call streams as it is
written and adds up to the whole answer's call; a call the model writes on its own
arrives whole at the end."""

from __future__ import annotations

import json
import random

import pytest

from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.reasoning import Phase
from sprig.runtime.server.tool_calls import BARE_JSON, FORMATS, ToolFormat

ARGS = '{"city": "Rome", "note": "a } and a \\" inside", "days": [1, {"n": 2}]}'
FORMS = {fmt.name: fmt for fmt in (*FORMATS.values(), BARE_JSON)}


def forced_text(fmt: ToolFormat, spaced: bool = True) -> str:
    """A forced answer as the forced regex lets a model write it (with or without the
    optional blanks)."""
    sep = (", ", ": ") if spaced else (",", ":")
    call = f'{{"name"{sep[1]}"get_weather"{sep[0]}"{fmt.args_key}"{sep[1]}{ARGS}}}'
    return fmt.forced_wrap[0] + call + fmt.forced_wrap[1]


def stream(fmt: AnswerFormat, text: str, seed: int) -> tuple[list[dict], bool]:
    """The deltas of `text` arriving in random pieces, and the last delta's `called`."""
    rng, state, deltas, at, called = random.Random(seed), DeltaState(), [], 0, False
    while at < len(text):
        step = rng.randint(1, 5)
        body, called = state.delta(fmt, text[at : at + step], at + step >= len(text))
        assert not called or at + step >= len(text)  # complete calls only once finished
        deltas.append(body)
        at += step
    return deltas, called


def joined_call(deltas: list[dict]) -> dict:
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    head = pieces[0]
    assert {"id", "type"} <= set(head) and all(set(p) == {"index", "function"} for p in pieces[1:])
    assert {p["index"] for p in pieces} == {0}
    return {"name": head["function"]["name"], "arguments": "".join(p["function"]["arguments"] for p in pieces)}


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("spaced", [True, False])
def test_a_forced_call_streams_as_written_and_adds_up_to_the_whole(name: str, spaced: bool) -> None:
    fmt = AnswerFormat(None, Phase.ANSWER, FORMS[name], frozenset({"get_weather"}), forced=True)
    text = forced_text(FORMS[name], spaced)
    message, called = fmt.message(text)
    [call] = message["tool_calls"]
    assert called and message["content"] is None
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    for seed in range(5):
        deltas, called = stream(fmt, text, seed)
        assert called and not any("content" in d for d in deltas)
        assert joined_call(deltas) == call["function"]
        assert sum("tool_calls" in d for d in deltas) > 3  # in pieces, not whole at the end


@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_forced_call_cut_short_holds_the_arguments_written(name: str) -> None:
    fmt = AnswerFormat(None, Phase.ANSWER, FORMS[name], frozenset({"get_weather"}), forced=True)
    text = forced_text(FORMS[name])
    cut = text[: text.index('"note"') + 4]
    message, called = fmt.message(cut)
    assert not called and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome", "not'}
    deltas, called = stream(fmt, cut, 0)
    assert not called and joined_call(deltas) == message["tool_calls"][0]["function"]
    before_args = text[: text.index(ARGS)]  # no arguments yet: the text is content, as an unparsed answer
    message, called = fmt.message(before_args)
    assert message == {"role": "assistant", "content": before_args.strip()} and not called
    deltas, _ = stream(fmt, before_args, 0)
    assert "".join(d.get("content", "") for d in deltas) == before_args.strip()


def test_a_call_the_model_writes_itself_arrives_whole_at_the_end() -> None:
    hermes = FORMATS["hermes"]
    fmt = AnswerFormat(None, Phase.ANSWER, hermes, frozenset({"get_weather"}))
    text = "Let me look.\n" + forced_text(hermes)
    deltas, called = stream(fmt, text, 0)
    assert called and [i for i, d in enumerate(deltas) if "tool_calls" in d] == [len(deltas) - 1]
    [call] = deltas[-1]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert "".join(d.get("content", "") for d in deltas) == "Let me look."
    assert json.loads(call["function"]["arguments"])["days"] == [1, {"n": 2}]


def gated_text(fmt: ToolFormat) -> str:
    """An "auto" answer as the grammar after the marker lets a model write it: content,
    the marker, then two calls."""
    one = f'{{"name": "get_weather", "{fmt.args_key}": {ARGS}}}'
    two = f'{{"name": "get_time", "{fmt.args_key}": {{}}}}'
    calls = fmt.forced_wrap[0] + one + fmt.separator + two + fmt.forced_wrap[1]
    return "Let me look.\n" + (calls if fmt.forced_wrap[0].startswith(fmt.trigger) else fmt.trigger + calls)


def joined_calls(deltas: list[dict]) -> list[dict]:
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    out: dict[int, dict] = {}
    for p in pieces:
        if p["index"] not in out:
            assert {"id", "type"} <= set(p) and p["index"] == len(out)
            out[p["index"]] = {"name": p["function"]["name"], "arguments": ""}
        else:
            assert set(p) == {"index", "function"}
        out[p["index"]]["arguments"] += p["function"]["arguments"]
    return [out[i] for i in range(len(out))]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_calls_after_the_marker_stream_as_written(name: str) -> None:
    """tool_choice "auto" with the calls constrained after the marker: content, then each
    call as it is written, adding up to the whole answer's calls; cut short, the last call
    holds the arguments written so far."""
    tools = FORMATS[name]
    fmt = AnswerFormat(None, Phase.ANSWER, tools, frozenset({"get_weather", "get_time"}), gated=True)
    text = gated_text(tools)
    message, called = fmt.message(text)
    assert called and message["content"] == "Let me look."
    functions = [c["function"] for c in message["tool_calls"]]
    assert functions == [{"name": "get_weather", "arguments": ARGS}, {"name": "get_time", "arguments": "{}"}]
    for seed in range(5):
        deltas, called = stream(fmt, text, seed)
        assert called and "".join(d.get("content", "") for d in deltas) == "Let me look."
        assert joined_calls(deltas) == functions
        assert sum("tool_calls" in d for d in deltas) > 3  # in pieces, not whole at the end
    cut = text[: text.index('"note"') + 4]
    message, called = fmt.message(cut)
    assert not called and message["content"] == "Let me look."
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Rome", "not'}]
    deltas, called = stream(fmt, cut, 1)
    assert not called and joined_calls(deltas) == [c["function"] for c in message["tool_calls"]]
    one = AnswerFormat(None, Phase.ANSWER, tools, fmt.tool_names, gated=True, one_call=True)
    assert [c["function"]["name"] for c in one.message(text)[0]["tool_calls"]] == ["get_weather"]
