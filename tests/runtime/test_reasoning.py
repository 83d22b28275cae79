"""Reasoning formats: where an output starts (read from the prompt), how its thinking is
split from its answer, and that streamed splits only ever append."""

from __future__ import annotations

import pytest

from sprig.runtime.server.config import HARMONY, REASONING_PARSERS, ServerConfig
from sprig.runtime.server.reasoning import REASONING_FORMATS, Phase

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]
OUTPUTS = [
    "<think>\nfirst, 2 + 2.\n</think>\n\nIt is 4.",
    "<think></think>4",
    "It is 4.",
    "  <think> a < b </thinking> </think>  done ",
    "<think>\nstill thinking when cut off",
    "reasoning with no opening tag</think>\nanswer",
]


@pytest.mark.parametrize(("prompt", "qwen3", "r1"), [
    ("<|user|>\nhi<|end|>\n<|assistant|>\n", Phase.MAYBE, Phase.THINKING),
    ("<|user|>\nhi<|end|>\n<|assistant|>\n<think>\n", Phase.THINKING, Phase.THINKING),  # R1's template
    ("<|assistant|>\n<think>\n\n</think>\n\n", Phase.ANSWER, Phase.ANSWER),  # Qwen3, enable_thinking=false
    ("<|assistant|>\n<think>old</think>4<|end|>\n<|user|>\nagain<|end|>\n<|assistant|>\n", Phase.MAYBE,
     Phase.THINKING),
])
def test_the_phase_comes_from_the_prompt(prompt: str, qwen3: Phase, r1: Phase) -> None:
    assert (QWEN3.phase(prompt), R1.phase(prompt)) == (qwen3, r1)


@pytest.mark.parametrize(("fmt", "phase", "text", "expected"), [
    (QWEN3, Phase.MAYBE, OUTPUTS[0], ("first, 2 + 2.", "It is 4.")),
    (QWEN3, Phase.MAYBE, OUTPUTS[1], ("", "4")),
    (QWEN3, Phase.MAYBE, OUTPUTS[2], (None, "It is 4.")),
    (QWEN3, Phase.MAYBE, OUTPUTS[3], ("a < b </thinking>", "done ")),
    (QWEN3, Phase.MAYBE, OUTPUTS[4], ("still thinking when cut off", "")),
    (QWEN3, Phase.ANSWER, OUTPUTS[0], (None, OUTPUTS[0])),
    (R1, Phase.THINKING, OUTPUTS[5], ("reasoning with no opening tag", "answer")),
    (R1, Phase.THINKING, OUTPUTS[0], ("first, 2 + 2.", "It is 4.")),  # a leading <think> is dropped
    (R1, Phase.THINKING, OUTPUTS[2], ("It is 4.", "")),  # never closed: all reasoning
])
def test_split(fmt, phase: Phase, text: str, expected: tuple) -> None:
    assert fmt.split(text, phase, finished=True) == expected


@pytest.mark.parametrize("fmt", [QWEN3, R1])
@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_splits_only_append(fmt, text: str) -> None:
    phase = fmt.phase("<|assistant|>\n")
    reasoning, content = fmt.split(text, phase, finished=True)
    for end in range(len(text) + 1):
        r, c = fmt.split(text[:end], phase, finished=False)
        assert (reasoning or "").startswith(r or ""), (text[:end], r)
        assert content.startswith(c), (text[:end], c)
        if r is not None and fmt.end not in text[:end]:
            assert not c  # no answer before the reasoning ends


def test_partial_markers_are_held_back() -> None:
    assert QWEN3.split("<th", Phase.MAYBE, finished=False) == (None, "")
    assert QWEN3.split("<think>abc</th", Phase.MAYBE, finished=False) == ("abc", "")
    assert QWEN3.split("<th", Phase.MAYBE, finished=True) == (None, "<th")


def test_sampling_defers_constraints_past_the_reasoning() -> None:
    assert QWEN3.sampling(Phase.ANSWER) == {}
    assert QWEN3.sampling(Phase.MAYBE) == {"reasoning_start": "<think>", "reasoning_end": "</think>"}
    assert R1.sampling(Phase.THINKING) == {"reasoning_start": None, "reasoning_end": "</think>"}


def test_the_server_setting_names_every_format() -> None:
    assert set(REASONING_PARSERS) == {*REASONING_FORMATS, HARMONY}  # harmony's reasoning: server.harmony
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="o1")
