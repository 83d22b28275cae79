"""A conversation of one demo task, with its known answers, and the streams that draw them.

Every task (`sprig.runtime.demo.mixture.TASKS`) draws `Dialogue`s from a seeded
`random.Random`. A dialogue is an OpenAI-style chat: its assistant turns are the targets
a model is trained on, and the same turns are the answers an evaluation grades against.
Dialogues are split into train and held-out sets by a stable hash of their user text
(`tasks.split_of`), so the two sets never share a question however many are drawn.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.demo.tasks import Split, split_of

Message = dict[str, Any]


@dataclass(frozen=True)
class Dialogue:
    """One conversation. `messages` alternate as a chat template expects (system first if
    any; assistant turns may carry OpenAI `tool_calls`); `tools` are OpenAI function tools
    for the template to render, or None; `schema` is the JSON schema an extraction answer
    follows; `answer` is what the last assistant turn must state for the dialogue to count
    as solved (graded by `sprig.runtime.demo.grading`)."""

    task: str
    messages: tuple[Message, ...]
    answer: str
    tools: tuple[dict[str, Any], ...] | None = None
    schema: dict[str, Any] | None = field(default=None)

    def key(self) -> str:
        """The text that decides the split: the task and every user and system turn."""
        turns = [m["content"] for m in self.messages if m["role"] in ("system", "user")]
        return "\n".join([self.task, *turns])

    def assistant_turns(self) -> list[int]:
        """Indices of the assistant messages."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def user(content: str) -> Message:
    return {"role": "user", "content": content}


def assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


def system(content: str) -> Message:
    return {"role": "system", "content": content}


def stream(make: Callable[[random.Random], Dialogue], split: Split, seed: int, name: str) -> Iterator[Dialogue]:
    """An endless, deterministic stream of distinct dialogues of one split from `make`."""
    rng = random.Random(f"{name}-{split}-{seed}")
    seen: set[str] = set()
    while True:
        d = make(rng)
        key = d.key()
        if key not in seen and split_of(key) == split:
            seen.add(key)
            yield d
