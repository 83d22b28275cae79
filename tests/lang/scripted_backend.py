"""A fake model for the language tests: scripted replies, character tokens, known logprobs.

Every character is a token. `logprob(context, char)` is a fixed deterministic function
(overridable), so a test can compute select scores by brute force. Replies come from a
function of the prompt text or a list consumed in order. Every call is recorded, and
meta_info is canned: prompt_tokens = len(text), completion_tokens = len(reply),
cached_tokens = the longest committed prefix of the text, e2e_latency = `latency`.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sprig.backend.base import Backend, ChoiceLogprobs, Generation, Prompt, StreamChunk
from sprig.chat_template import ChatTemplate, get_chat_template
from sprig.cost import Cost
from sprig.sampling import GenParams


def default_logprob(context: str, char: str) -> float:
    """A deterministic 'model': a logprob in [-4, -0.05] from the last 6 context chars."""
    h = zlib.crc32(f"{context[-6:]}|{char}".encode())
    return -0.05 - (h % 1000) / 1000 * 3.95


@dataclass(frozen=True)
class Call:
    kind: str  # "generate" | "stream" | "score" | "commit"
    prompt: Prompt
    params: GenParams | None = None
    choices: tuple[str, ...] = ()


class ScriptedBackend(Backend):
    def __init__(
        self,
        replies: Callable[[str, GenParams], str] | Sequence[str] = (),
        *,
        logprob: Callable[[str, str], float] = default_logprob,
        chat_template: ChatTemplate | None = None,
        delay: float = 0.0,
        chunk: int = 3,
        latency: float = 0.01,
        after_chunk: Callable[[int], None] | None = None,
    ) -> None:
        self._replies = replies if callable(replies) else list(replies)
        self.logprob = logprob
        self.chat_template = chat_template or get_chat_template("default")
        self.delay, self.chunk, self.latency = delay, chunk, latency
        self.after_chunk = after_chunk  # called with len(prompt + streamed so far)
        self.calls: list[Call] = []
        self.committed: list[str] = []
        self._lock = threading.Lock()
        self._active = 0
        self.max_concurrent = 0

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def _reply(self, text: str, params: GenParams) -> str:
        if callable(self._replies):
            return self._replies(text, params)
        with self._lock:
            if not self._replies:
                raise AssertionError(f"the script ran out of replies at {text!r}")
            return self._replies.pop(0)

    def _meta(self, text: str, out: str) -> dict[str, Any]:
        with self._lock:
            cached = max((len(p) for p in self.committed if text.startswith(p)), default=0)
        return {"prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": cached,
                "e2e_latency": self.latency, "finish_reason": {"type": "stop"}}

    def _one(self, text: str, params: GenParams) -> tuple[str, dict[str, Any]]:
        with self._lock:
            self._active += 1
            self.max_concurrent = max(self.max_concurrent, self._active)
        try:
            time.sleep(self.delay)
            out = self._reply(text, params)
        finally:
            with self._lock:
                self._active -= 1
        meta = self._meta(text, out)
        if params.return_logprob:
            meta["output_token_logprobs"] = [
                [self.logprob(text + out[:i], ch), ord(ch), ch] for i, ch in enumerate(out)
            ]
        return out, meta

    def generate(self, prompt: Prompt, params: GenParams) -> Generation:
        self._record(Call("generate", prompt, params))
        if (params.n or 1) == 1:
            out, meta = self._one(prompt.text, params)
            return Generation(out, meta, Cost.of_call(meta, 0.0))
        pairs = [self._one(prompt.text, params) for _ in range(params.n or 1)]
        metas = tuple(m for _, m in pairs)
        return Generation(tuple(o for o, _ in pairs), metas, Cost.of_call(metas, 0.0))

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[StreamChunk]:
        self._record(Call("stream", prompt, params))
        out, meta = self._one(prompt.text, params)
        for start in range(0, len(out), self.chunk):
            yield StreamChunk(out[start:start + self.chunk], meta, Cost.of_call(meta, 0.0))
            if self.after_chunk is not None:
                self.after_chunk(len(prompt.text) + min(start + self.chunk, len(out)))

    def score_choices(self, prompt: Prompt, choices: Sequence[str], unconditional: bool) -> ChoiceLogprobs:
        self._record(Call("score", prompt, choices=tuple(choices)))
        text = prompt.text
        cond = [[[self.logprob(text + c[:i], ch), ord(ch), ch] for i, ch in enumerate(c)] for c in choices]
        alone = None
        if unconditional:
            alone = [[[None if i == 0 else self.logprob(c[:i], ch), ord(ch), ch] for i, ch in enumerate(c)]
                     for c in choices]
        metas = [self._meta(text + c, "") for c in choices]
        return ChoiceLogprobs(cond, alone, Cost.of_call(metas, 0.0))

    def commit(self, prompt: Prompt) -> Cost:
        self._record(Call("commit", prompt))
        meta = self._meta(prompt.text, "")
        with self._lock:
            self.committed.append(prompt.text)
        return Cost.of_call(meta, 0.0)

    def kinds(self) -> list[str]:
        return [c.kind for c in self.calls]
