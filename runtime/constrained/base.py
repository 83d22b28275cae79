"""The grammar-backend interface, implemented over outlines-core and over llguidance.

A `GrammarSpec` says what to enforce; `GrammarBackend.compile` turns it into a
`CompiledGrammar` (slow, shareable, cached by `GrammarCompiler`; it runs in a worker
process, and `GrammarBackend.prepare` then readies the result in the serving process);
`GrammarBackend.matcher` makes a per-request `Grammar` from it (cheap). Per decode step the scheduler calls
`fill_bitmask`, applies the mask to the logits, samples, then `accept_token`.

Bitmask layout (xgrammar's, and `sprig.kernels.logit_mask`'s): int32 words, bit j of word
w set means token 32*w + j is allowed; a row has `bitmask_width(logits_width)` words.
This module imports no torch, so a compile worker process starts fast.
"""

from __future__ import annotations

import codecs
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

GRAMMAR_KINDS = ("regex", "json_schema", "choices", "ebnf")
# Between JSON tokens by default: one optional space, where `json.dumps` writes one (after
# `,` and `:`), as outlines' default; a model that learned JSON so keeps its own tokens.
JSON_WHITESPACE = "[ ]?"


class GrammarTimeoutError(TimeoutError):
    """Compiling a grammar took longer than the compile timeout (its worker was killed).
    Like a `ValueError` from `compile`, it is the request's fault: answer 400."""


def bitmask_width(logits_width: int) -> int:
    """int32 words per bitmask row for logits of width `logits_width`."""
    return (logits_width + 31) // 32


def check_bitmask_row(row: torch.Tensor, num_tokens: int) -> None:
    """`ValueError` unless `row` is a contiguous 1-D int32 CPU tensor with a bit for each
    of `num_tokens` tokens."""
    if not (row.dim() == 1 and row.element_size() == 4 and not row.is_floating_point()):
        raise ValueError("bitmask_row must be a 1-D int32 tensor")
    if row.device.type != "cpu" or not row.is_contiguous():
        raise ValueError("bitmask_row must be a contiguous CPU tensor")
    if row.numel() < bitmask_width(num_tokens):
        raise ValueError(
            f"bitmask_row has {row.numel()} words; the vocabulary needs {bitmask_width(num_tokens)}"
        )


def forced_text(data: bytes) -> str | None:
    """The whole characters that forced output bytes `data` start with; None if there are
    none, or `data` starts mid-character (the next token completes that one first) or is
    not UTF-8."""
    if not data or 0x80 <= data[0] < 0xC0:
        return None
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data) or None
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class GrammarSpec:
    """What to enforce, hashable (the compile-cache key) and picklable.

    kind "regex": `text` is the regex the whole output must match. kind "json_schema":
    `text` is the schema as a JSON string, `whitespace` the regex allowed between JSON
    tokens ("" = compact JSON; `JSON_WHITESPACE` by default). kind "choices": `text` is a JSON array of literal strings,
    the output must be exactly one of them. kind "ebnf": `text` is a context-free grammar,
    GBNF (`root ::= ...`, the EBNF dialect SGLang's `ebnf` takes) or Lark (`start: ...`);
    the output must be a sentence of it.
    """

    kind: str
    text: str
    whitespace: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}; got {self.kind!r}")
        if not isinstance(self.text, str) or not isinstance(self.whitespace, str):
            raise ValueError("grammar text and whitespace must be strings")
        if self.whitespace and self.kind != "json_schema":
            raise ValueError("a whitespace pattern applies only to json_schema grammars")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any], *, whitespace: str = JSON_WHITESPACE) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, whitespace)

    @classmethod
    def choices(cls, options: Sequence[str]) -> GrammarSpec:
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise ValueError("choices must be a list of strings")
        return cls("choices", json.dumps(list(options)))

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)


def spec_from_params(params: Any) -> GrammarSpec | None:
    """The grammar a `SamplingParams` asks for (its `regex`, `json_schema` or `ebnf`), or None."""
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    return None


class CompiledGrammar(Protocol):
    """A compiled, immutable, picklable grammar; shared by every request with its spec.
    `fingerprint` is that of the backend that compiled it."""

    spec: GrammarSpec
    fingerprint: str


class Grammar(ABC):
    """One request's position in its grammar (a matcher).

    Invariants: a token is accepted only if the last `fill_bitmask` allowed it; stop
    tokens (EOS and the model's other stop ids) are allowed only in a final state
    (`is_terminated`), and accepting one ends the grammar; `rollback(k)` undoes the last
    k accepted tokens exactly, for k up to `max_rollback`.
    """

    max_rollback: int

    @abstractmethod
    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        """Overwrite `bitmask_row` ([W] int32, CPU, W >= bitmask_width(logits width))
        with this state's allowed tokens; ids the tokenizer lacks are disallowed."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance over `token_id`; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, k: int) -> list[int]:
        """Undo the last `k` accepted tokens; returns them, oldest first."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """In a final state (stop tokens allowed), or a stop token was accepted."""

    @abstractmethod
    def is_finished(self) -> bool:
        """Generation must end: a stop token was accepted, or a final state that admits
        no further token."""

    @abstractmethod
    def forced_continuation(self) -> str | None:
        """The text every valid continuation starts with, up to the next choice or final
        state, in whole characters; None when the next character is not forced or the
        output ends mid-character."""

    def can_continue(self) -> bool:
        return not self.is_finished()

    def allows_all(self) -> bool:
        """Whether the next `fill_bitmask` allows every token, so the mask may be skipped
        (False where not known cheaply)."""
        return False

    def accept_tokens(self, token_ids: Iterable[int]) -> bool:
        """Accept all of `token_ids` or none: on a refusal the state is unchanged."""
        for accepted, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                self.rollback(accepted)
                return False
        return True

    def jump_forward(self, token_ids: Sequence[int], *, rollback: int = 0) -> bool:
        """Replace the last `rollback` accepted tokens by `token_ids` (the retokenized
        text of those tokens plus `forced_continuation()`); all or nothing."""
        removed = self.rollback(rollback)
        if self.accept_tokens(token_ids):
            return True
        if not self.accept_tokens(removed):
            raise RuntimeError("grammar could not re-accept its own rolled-back tokens")
        return False


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer. Must be picklable (it is sent to compile workers).

    `fingerprint` identifies the tokenizer's vocabulary (part of every cache key);
    `compile` raises `ValueError` naming the problem for an invalid or unenforceable spec;
    `prepare` takes what a worker's `compile` returned (unpickled in the serving process)
    and builds what cannot cross a process boundary; it runs on the compiler's threads,
    never on the scheduler's, and its result is what `matcher` receives.
    """

    fingerprint: str

    def compile(self, spec: GrammarSpec) -> CompiledGrammar: ...

    def prepare(self, compiled: CompiledGrammar) -> CompiledGrammar: ...

    def matcher(
        self,
        compiled: CompiledGrammar,
        *,
        stop_token_ids: Iterable[int] | None = None,
        max_rollback: int = 64,
    ) -> Grammar: ...
