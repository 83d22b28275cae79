"""Mistral's v11 tool calls (`mistral_v11`, `[TOOL_CALLS]NAME[ARGS]{...}`): answers as
Mistral's models write them parse into calls or stay content, whole and streamed, without
marker text; the forced and gated regexes admit valid calls only, also as the grammar
backends compile them for a tokenizer whose markers are special tokens; "mistral" picks
the v11 format from a template that writes `[ARGS]`."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import jsonschema
import pytest
from mistral_checkpoint import MARKERS, SCRIPT_TEXT, TEMPLATE, add_mistral_tokens

from sprig.runtime.constrained import GrammarSpec, GuidanceBackend, OutlinesBackend
from sprig.runtime.constrained.regex_text import lark_grammar
from sprig.runtime.constrained.vocabulary import special_token_ids
from sprig.runtime.server.answer_decoding import answer_decoding
from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.mistral_tool_calls import MistralToolFormat
from sprig.runtime.server.reasoning import Phase
from sprig.runtime.server.tool_calls import FORMATS, ToolCall, plan_tool_use
from sprig.runtime.server.tool_formats import TOOL_FORMATS, detect_format, resolve_format
from sprig.runtime.tiny_checkpoint import build_tokenizer

FMT = MistralToolFormat()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = frozenset({"get_weather", "get_time"})
OLD_TEMPLATE = "{{ '[TOOL_CALLS] ' + calls | tojson }}"  # pre-v11: a JSON list after the marker


@pytest.mark.parametrize("text,expected", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', ("", [ToolCall("get_weather", '{"city": "Paris"}')])),
    ('Let me look.\n[TOOL_CALLS]get_weather[ARGS]{"city":"Rome","days":3}[TOOL_CALLS]get_time[ARGS]{}',
     ("Let me look.", [ToolCall("get_weather", '{"city":"Rome","days":3}'), ToolCall("get_time", "{}")])),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "é"}\n',
     ("", [ToolCall("get_weather", '{"city": "é"}')])),
    ('ok [TOOL_CALLS]get_time{} [TOOL_CALLS]get_time[ARGS] {"a": {"b": [1]}}',
     ("ok", [ToolCall("get_time", "{}"), ToolCall("get_time", '{"a": {"b": [1]}}')])),
])
def test_calls_as_mistral_models_write_them_parse(text: str, expected: tuple[str, list[ToolCall]]) -> None:
    assert FMT.parse(text) == expected
    assert FMT.split(text, True, NAMES) == expected


@pytest.mark.parametrize("text", [
    "no call at all",
    "[TOOL_CALLS]get_weather[ARGS]",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"',
    '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
    '[TOOL_CALLS][ARGS]{"city": "Paris"}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]',  # the pre-v11 list
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time',
    "[TOOL_CALLS]get_time[ARGS]" + "{\"a\": " * 200 + "1" + "}" * 200,
])
def test_anything_but_well_formed_calls_stays_content_without_markers(text: str) -> None:
    content, calls = FMT.split(text, True, NAMES)
    assert FMT.parse(text) is None and calls == [] and FMT.split(text, True) == (content, [])
    assert not any(m in content for m in ("[TOOL_CALLS]", "[ARGS]"))


def test_a_call_of_a_function_not_offered_stays_content() -> None:
    text = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]rm_rf[ARGS]{}'
    assert [c.name for c in FMT.split(text, True)[1]] == ["get_weather", "rm_rf"]
    assert FMT.split(text, True, NAMES) == ('Sure.get_weather{"city": "Paris"}rm_rf{}', [])


def test_streamed_content_stops_before_a_marker_and_only_grows() -> None:
    text = 'I will [ARGS]check [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    seen = [FMT.split(text[:n], False)[0] for n in range(len(text) + 1)]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(seen))
    assert seen[-1] == "I will check" and not any("[" in s for s in seen)
    assert FMT.split("Hm [TOOL_C", False) == ("Hm", []) and FMT.split("Hm [AR", False) == ("Hm", [])


def test_calls_stream_as_written_and_add_up_to_the_whole() -> None:
    written = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}[TOOL_CALLS]get_time[ARGS]{}'
    whole = FMT.parse(written)[1]
    previous: list[tuple[str, str, bool]] = []
    for n in range(len(written) + 1):
        calls = FMT.partial_calls(written[:n])
        assert len(calls) >= len(previous)
        for (name, args, done), (old_name, old_args, old_done) in zip(calls[: len(previous)], previous, strict=True):
            assert name == old_name and args.startswith(old_args) and done >= old_done
        previous = calls
    assert [(c.name, c.arguments) for c in whole] == [(n, a) for n, a, done in previous if done]
    assert FMT.partial_calls("[TOOL_CALLS]get_wea") == [] and FMT.partial_calls("[TOOL_CALLS]get_weather[ARGS]") == []
    assert FMT.partial_calls('[TOOL_CALLS]get_weather[ARGS]{"ci') == [("get_weather", '{"ci', False)]


def test_a_gated_answer_streams_content_and_calls_that_add_up() -> None:
    """Through the chat answer: the content before the marker streams without marker text,
    the call by pieces (name first), both adding up to the finished message."""
    plan = plan_tool_use([WEATHER, TIME], "auto", FMT, None)
    fmt = AnswerFormat(None, Phase.ANSWER, plan.parse_format, plan.names, gated=plan.trigger is not None)
    text = 'Sure, [ARGS]one moment.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    state, deltas = DeltaState(), []
    for i, ch in enumerate(text):
        deltas.append(state.delta(fmt, ch, i == len(text) - 1)[0])
    message, complete = fmt.message(text)
    assert complete and message["content"] == "Sure, one moment."
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    pieces = [p for d in deltas for p in d.get("tool_calls", ())]
    for i, call in enumerate(message["tool_calls"]):
        mine = [p for p in pieces if p["index"] == i]
        assert mine[0]["function"]["name"] == call["function"]["name"]
        assert "".join(p["function"]["arguments"] for p in mine) == call["function"]["arguments"]
    one = AnswerFormat(None, Phase.ANSWER, plan.parse_format, plan.names, gated=True, one_call=True)
    assert [c["function"]["name"] for c in one.message(text)[0]["tool_calls"]] == ["get_weather"]


def test_forced_and_gated_regexes_admit_only_valid_calls() -> None:
    plan = plan_tool_use([WEATHER, TIME], "required", FMT, None)
    assert plan.forced and plan.parse_format is FMT
    for text, ok in (('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}', True),
                     ("[TOOL_CALLS]get_time[ARGS]{}", True),
                     ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', False),
                     ('[TOOL_CALLS]get_weather[ARGS]{"days": 3}', False),
                     ('get_weather[ARGS]{"city": "Rome"}', False),
                     ("[TOOL_CALLS]get_price[ARGS]{}", False),
                     ("[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[ARGS]{}", False)):  # forced: one call
        assert (re.fullmatch(plan.regex, text) is not None) == ok, text
        if ok:
            [call] = FMT.parse(text)[1]
            jsonschema.validate(json.loads(call.arguments), {"get_time": {}, **{"get_weather": WEATHER["function"][
                "parameters"]}}[call.name])
    named = plan_tool_use([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, FMT, None)
    assert re.fullmatch(named.regex, "[TOOL_CALLS]get_time[ARGS]{}")
    assert not re.fullmatch(named.regex, '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    auto = plan_tool_use([WEATHER, TIME], "auto", FMT, None)
    assert auto.trigger == "[TOOL_CALLS]" and not auto.forced
    two = 'get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    assert re.fullmatch(auto.regex, two) and not re.fullmatch(auto.regex, two.replace("Rome", "Oslo"))
    single = plan_tool_use([WEATHER, TIME], "auto", FMT, None, several=False)  # parallel_tool_calls: false
    assert not re.fullmatch(single.regex, two) and re.fullmatch(single.regex, "get_time[ARGS]{}")


def test_mistral_picks_the_v11_format_from_the_template_or_the_vocabulary() -> None:
    v11 = TOOL_FORMATS["mistral_v11"]
    assert resolve_format("mistral", OLD_TEMPLATE, {"[TOOL_CALLS]": 5, "[ARGS]": 32}) is v11
    assert detect_format(TEMPLATE) is v11 and resolve_format("auto", TEMPLATE) is v11
    assert resolve_format("mistral", TEMPLATE) is v11 and resolve_format("mistral_v11", None) is v11
    assert detect_format(OLD_TEMPLATE) is FORMATS["mistral"] and resolve_format("mistral", OLD_TEMPLATE) is FORMATS[
        "mistral"]
    assert resolve_format("mistral", None) is FORMATS["mistral"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("mistral-tok")
    build_tokenizer(path)
    return add_mistral_tokens(Path(path))


def test_the_markers_are_special_tokens_kept_in_what_the_format_reads(tokenizer) -> None:
    """Decoding that skips special tokens drops the markers, so a request read in this
    format decodes with them (and every special token) kept, and reads that text without
    the others: the stop token that ends the answer. Other formats decode as asked."""
    ids = [*tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False), tokenizer.eos_token_id]
    assert all(tokenizer.convert_tokens_to_ids(m) in special_token_ids(tokenizer) for m in MARKERS)
    assert FMT.split(tokenizer.decode(ids, skip_special_tokens=True), True, NAMES)[1] == []
    decoding = answer_decoding(None, FMT, tokenizer)
    assert decoding.params == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    kept = tokenizer.decode(ids, **decoding.params)
    assert kept == SCRIPT_TEXT + "</s>" and FMT.split(kept, True, NAMES)[1] == []
    read = decoding.read(kept)
    assert FMT.split(read, True, NAMES) == ("Sure.", [ToolCall("get_weather", '{"city": "Paris"}')])
    assert FMT.split(decoding.read("[INST] gamma</s>"), True, NAMES) == ("gamma", [])
    assert FMT.partial_calls(FMT.marked_calls(read)[1]) == [("get_weather", '{"city": "Paris"}', True)]
    fmt = AnswerFormat(None, Phase.ANSWER, FMT, NAMES, decoding=decoding)
    assert fmt.message(kept)[0]["content"] == "Sure." and not fmt.plain
    for other in (FORMATS["hermes"], None):
        assert answer_decoding(None, other, tokenizer).params == {} and answer_decoding(None, other, tokenizer).read(
            kept) == kept


@pytest.mark.parametrize("backend_kind", ["outlines", "llguidance"])
def test_a_forced_call_spells_its_markers_as_text(tokenizer, backend_kind: str) -> None:
    """Special tokens write no text, so a grammar cannot produce them: the forced call is
    taken as text tokens (its markers spelt out, which decode to the same text whether
    special tokens are skipped or not), and the special marker tokens are refused."""
    plan = plan_tool_use([WEATHER, TIME], "required", FMT, None)
    if backend_kind == "outlines":
        backend = OutlinesBackend.from_tokenizer(tokenizer)
        compiled = backend.prepare(backend.compile(GrammarSpec.regex(plan.regex)))
    else:
        backend = GuidanceBackend.from_tokenizer(tokenizer)
        compiled = backend.prepare(backend.compile(GrammarSpec("ebnf", lark_grammar(plan.regex))))

    def takes(ids: list[int]) -> bool:
        grammar = backend.matcher(compiled, stop_token_ids={tokenizer.eos_token_id})
        return grammar.accept_tokens(ids) and grammar.is_terminated()

    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    spelt = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    special = tokenizer.encode(text, add_special_tokens=False)
    assert len(spelt) > len(special) and takes(spelt) and not takes(special)
    assert tokenizer.decode(spelt, skip_special_tokens=True) == text
    assert not takes(tokenizer.encode(text.replace("Rome", "Oslo"), add_special_tokens=False,
                                      split_special_tokens=True))
