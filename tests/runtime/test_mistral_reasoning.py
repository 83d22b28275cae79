"""Magistral's reasoning (`--reasoning-parser mistral`, `[THINK] ... [/THINK]`, both
special tokens): where an output starts, read from prompts as Magistral's template renders
them; the split of outputs as Magistral writes them, with no marker text in either part
(as vLLM reads them: a reasoning needs its `[THINK]`); streamed splits that only append;
and the decoding that keeps the markers (and, with tools, the calls' markers) while the
other special tokens' text, the stop token's among them, is read out."""

from __future__ import annotations

from pathlib import Path

import pytest
from magistral_checkpoint import REASONING, SCRIPT_TEXT, TEMPLATE, THINKING_MARKERS, THOUGHTS
from mistral_checkpoint import MARKERS, WORDS, add_mistral_tokens

from sprig.runtime.server.answer_decoding import answer_decoding
from sprig.runtime.server.chat_answer import AnswerFormat, DeltaState
from sprig.runtime.server.config import REASONING_PARSERS, ServerConfig
from sprig.runtime.server.mistral_tool_calls import MistralToolFormat
from sprig.runtime.server.reasoning import REASONING_FORMATS, Phase
from sprig.runtime.server.tool_calls import ToolCall
from sprig.runtime.tiny_checkpoint import build_tokenizer

MISTRAL = REASONING_FORMATS["mistral"]
SYSTEM = ("[SYSTEM_PROMPT]First draft your thinking process until you arrive at a response. Your thinking process "
          "must follow the template below:[THINK]Your thoughts or/and draft.[/THINK]Here, provide a self-contained "
          "response.[/SYSTEM_PROMPT]")
OUTPUTS = [
    "[THINK]Okay, the user asks for 2 + 2.\nThat is 4.[/THINK]The answer is **4**.",
    "[THINK]\nLet me see: [x] and [y].\n[/THINK]\n\n$4$",
    "The answer is 4.",
    "[THINK]still thinking when cut off",
    "a stray end[/THINK] and the rest",
    "[THINK]first[/THINK]then[THINK] again[/THINK] done",
    "[THINK][/THINK]4",
]


@pytest.mark.parametrize(("prompt", "phase"), [
    (f"<s>{SYSTEM}[INST]What is 2 + 2?[/INST]", Phase.MAYBE),  # the default system prompt spells both markers
    ("<s>[SYSTEM_PROMPT]Answer briefly.[/SYSTEM_PROMPT][INST]What is 2 + 2?[/INST]", Phase.MAYBE),
    (f"<s>{SYSTEM}[INST]hi[/INST][THINK]greet[/THINK]Hello!</s>[INST]2 + 2?[/INST]", Phase.MAYBE),
    (f"<s>{SYSTEM}[INST]2 + 2?[/INST][THINK]Let me", Phase.THINKING),  # a continued final message
    (f"<s>{SYSTEM}[INST]2 + 2?[/INST][THINK]done[/THINK]", Phase.ANSWER),
])
def test_the_phase_comes_from_the_prompt(prompt: str, phase: Phase) -> None:
    assert MISTRAL.phase(prompt) == phase


@pytest.mark.parametrize(("text", "expected"), [
    (OUTPUTS[0], ("Okay, the user asks for 2 + 2.\nThat is 4.", "The answer is **4**.")),
    (OUTPUTS[1], ("Let me see: [x] and [y].", "$4$")),
    (OUTPUTS[2], (None, "The answer is 4.")),  # answers at once
    (OUTPUTS[3], ("still thinking when cut off", "")),
    (OUTPUTS[4], (None, "a stray end and the rest")),  # no [THINK]: all content, without the marker
    (OUTPUTS[5], ("first", "then again done")),
    (OUTPUTS[6], ("", "4")),
])
def test_split(text: str, expected: tuple[str | None, str]) -> None:
    assert MISTRAL.split(text, Phase.MAYBE, finished=True) == expected


def test_a_prompt_that_opened_the_reasoning_starts_inside_it() -> None:
    assert MISTRAL.split(" so 4.[/THINK]4", Phase.THINKING, finished=True) == ("so 4.", "4")
    assert MISTRAL.split("[THINK]x[/THINK]4", Phase.ANSWER, finished=True) == (None, "x4")


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_splits_only_append_and_never_show_a_marker(text: str) -> None:
    reasoning, content = MISTRAL.split(text, Phase.MAYBE, finished=True)
    for end in range(len(text) + 1):
        r, c = MISTRAL.split(text[:end], Phase.MAYBE, finished=False)
        assert (reasoning or "").startswith(r or ""), (text[:end], r)
        assert content.startswith(c), (text[:end], c)
        assert not any(m in part for m in MISTRAL.markers for part in (r or "", c))
        if r is not None and MISTRAL.end not in text[:end]:
            assert not c  # no answer before the reasoning ends


def test_sampling_defers_constraints_past_the_end_marker() -> None:
    assert MISTRAL.sampling(Phase.MAYBE) == {"reasoning_start": "[THINK]", "reasoning_end": "[/THINK]"}
    assert MISTRAL.sampling(Phase.ANSWER) == {}


def test_the_server_takes_mistral_and_a_budget_with_it() -> None:
    assert "mistral" in REASONING_PARSERS
    assert ServerConfig(reasoning_parser="mistral", thinking_budget=8).thinking_budget == 8
    assert not REASONING_FORMATS["qwen3"].special and MISTRAL.special


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    path = Path(tmp_path_factory.mktemp("magistral-tok"))
    build_tokenizer(path)
    return add_mistral_tokens(path, [*MARKERS, *THINKING_MARKERS], [*WORDS, *THOUGHTS], TEMPLATE)


def test_one_decoding_keeps_the_markers_of_both_formats(tokenizer) -> None:
    """Decoding that skips special tokens loses the markers; the request is decoded with
    them kept, and read without the others (`</s>`, `[INST]`): without tools the calls'
    markers are read out as skipping would have, with tools they are the calls'."""
    ids = [*tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False), tokenizer.eos_token_id]
    assert MISTRAL.split(tokenizer.decode(ids, skip_special_tokens=True), Phase.MAYBE, True)[0] is None
    alone, with_tools = answer_decoding(MISTRAL, None, tokenizer), answer_decoding(MISTRAL, MistralToolFormat(),
                                                                                   tokenizer)
    assert alone.params == with_tools.params == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    kept = tokenizer.decode(ids, **alone.params)
    assert kept == SCRIPT_TEXT + "</s>"
    assert alone.read(kept) == '[THINK] alpha beta[/THINK] Sure.get_weather{"city": "Paris"}'
    assert with_tools.read("[INST]" + kept) == SCRIPT_TEXT
    assert answer_decoding(REASONING_FORMATS["qwen3"], None, tokenizer).params == {}

    plain = AnswerFormat(MISTRAL, Phase.MAYBE, None, decoding=alone)
    assert plain.message(kept)[0] == {"role": "assistant", "reasoning_content": REASONING,
                                      "content": 'Sure.get_weather{"city": "Paris"}'}
    tools = AnswerFormat(MISTRAL, Phase.MAYBE, MistralToolFormat(), frozenset({"get_weather"}), decoding=with_tools)
    message, called = tools.message(kept)
    assert called and (message["reasoning_content"], message["content"]) == (REASONING, "Sure.")
    assert message["tool_calls"][0]["function"] == ToolCall("get_weather", '{"city": "Paris"}').openai()["function"]
    unsplit = AnswerFormat(None, Phase.MAYBE, None, decoding=alone)  # separate_reasoning: false
    assert not unsplit.plain and unsplit.message(kept)[0]["content"] == alone.read(kept)

    pieces = [tokenizer.decode([i], **alone.params) for i in ids]
    state, deltas = DeltaState(), []
    for k, piece in enumerate(pieces):
        deltas.append(state.delta(tools, piece, k == len(pieces) - 1)[0])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", ())] == ["get_weather"]
