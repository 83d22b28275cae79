"""How a chat answer is decoded for reading, decided in one place for both formats that
read it: the reasoning's (`server.reasoning`) and the tool calls' (`server.tool_formats`).

Decoding that skips special tokens (a request's default) drops markers that are special
tokens: Mistral's `[THINK]` and `[/THINK]` (`--reasoning-parser mistral`) and its v11 tool
calls' `[TOOL_CALLS]`, `[CALL_ID]` and `[ARGS]` (`mistral_v11`). A request read in such a
format is decoded with every special token kept (`KEEP_MARKERS`), and read without the
text of the tokenizer's other special tokens (the stop token `</s>` that ends an answer,
`[INST]`, ...), as decoding that skips them would have written it. Magistral with tools
(reasoning, then calls) keeps the markers of both. Every other request is decoded as it
asks and read as decoded.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.constrained.vocabulary import special_token_ids
from sprig.runtime.server.mistral_tool_calls import MistralToolFormat
from sprig.runtime.server.reasoning import ReasoningFormat
from sprig.runtime.server.tool_calls import CallFormat

KEEP_MARKERS = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
# per tokenizer, per set of kept markers: the other special tokens' text
_OTHERS: weakref.WeakKeyDictionary[Any, dict[frozenset[str], re.Pattern[str] | None]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AnswerDecoding:
    """`params`: the decoding parameters a request adds to its sampling parameters;
    `dropped`: the text read out of the decoded answer before any format reads it (None:
    the answer is read as decoded). Removing whole special tokens' text keeps a growing
    text's reading a prefix of the finished one (a token's text arrives whole)."""

    params: dict[str, bool] = field(default_factory=dict)
    dropped: re.Pattern[str] | None = None

    def read(self, text: str) -> str:
        """`text` as the formats read it."""
        return text if self.dropped is None else self.dropped.sub("", text)


def _special_markers(reasoning: ReasoningFormat | None, calls: CallFormat | None) -> frozenset[str]:
    """The markers of `reasoning` and `calls` that are special tokens."""
    markers = set(reasoning.markers) if reasoning is not None and reasoning.special else set()
    if isinstance(calls, MistralToolFormat):
        markers.update(calls.markers)
    return frozenset(markers)


def answer_decoding(reasoning: ReasoningFormat | None, calls: CallFormat | None, tokenizer: Any) -> AnswerDecoding:
    """How an answer read in `reasoning` (None: not split) and `calls` (None: no tool
    calls) is decoded and read (see the module docstring)."""
    markers = _special_markers(reasoning, calls)
    if not markers:
        return AnswerDecoding()
    known = _OTHERS.setdefault(tokenizer, {})
    if markers not in known:
        names = tokenizer.convert_ids_to_tokens(sorted(special_token_ids(tokenizer)))
        others = sorted({n for n in names if n and n not in markers}, key=len, reverse=True)
        known[markers] = re.compile("|".join(map(re.escape, others))) if others else None
    return AnswerDecoding(dict(KEEP_MARKERS), known[markers])
