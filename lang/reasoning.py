"""`separate_reasoning`: a reasoning model's thinking split from its answer, in a program.

`s += sgl.separate_reasoning(sgl.gen("answer"), model_type="qwen3")` binds `answer` to the
text after the reasoning and `answer_reasoning_content` to the reasoning, and keeps only
the answer in the state's text (later calls do not see the thinking), as SGLang's
frontend does. Formats, by SGLang's model_type names:
- `deepseek-r1` (also `step3`, `qwen3-thinking`, `minimax`): the output starts inside
  the reasoning, which ends at `</think>`; a leading `<think>` is dropped;
- `qwen3`, `glm45`: reasoning only if the output opens `<think>`;
- `kimi`: the same with `◁think▷ ... ◁/think▷`.
An output whose reasoning never ends is all reasoning (it was cut short).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_inside: bool  # the output begins in the reasoning (the template opened it)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a finished output; ("", text) when it has none."""
        body = text.lstrip()
        opened = body.startswith(self.start)
        if not (opened or self.starts_inside):
            return "", text
        if opened:
            body = body[len(self.start) :]
        reasoning, ended, answer = body.partition(self.end)
        return reasoning.strip(), answer.lstrip() if ended else ""


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, starts_inside=True),
    "step3": ReasoningFormat(*_THINK, starts_inside=True),
    "qwen3-thinking": ReasoningFormat(*_THINK, starts_inside=True),
    "minimax": ReasoningFormat(*_THINK, starts_inside=True),
    "qwen3": ReasoningFormat(*_THINK, starts_inside=False),
    "glm45": ReasoningFormat(*_THINK, starts_inside=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", starts_inside=False),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    """The format named `model_type` (case-insensitive); `ValueError` naming the known ones."""
    found = FORMATS.get((model_type or "").lower())
    if found is None:
        raise ValueError(f"separate_reasoning needs model_type, one of {sorted(FORMATS)}; got {model_type!r}")
    return found


def reasoning_name(name: str) -> str:
    """The variable that holds the reasoning of the gen or select bound to `name`."""
    return f"{name}_reasoning_content"
