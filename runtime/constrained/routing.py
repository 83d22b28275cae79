"""Which backend compiles which kind of grammar.

Context-free grammars (`ebnf`) go to llguidance, the one backend here that parses them.
Regexes, JSON schemas and choices go to the backend `regular` names; both compile them
to the same regex (`spec_regex`), so they enforce the same outputs, at different costs
(`benchmarks/bench_grammar_backends.py`; RESULTS.md has a run): outlines-core computes a
token automaton up front (slow to compile, seconds for a large schema over a large
vocabulary; cheap masks), llguidance computes masks lazily (compiles in milliseconds;
each mask costs more).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.constrained.base import CompiledGrammar, Grammar, GrammarBackend, GrammarSpec
from sprig.runtime.constrained.guidance_backend import GuidanceBackend
from sprig.runtime.constrained.outlines_backend import OutlinesBackend

REGULAR_BACKENDS: dict[str, Callable[..., GrammarBackend]] = {
    "outlines": OutlinesBackend.from_tokenizer,
    "llguidance": GuidanceBackend.from_tokenizer,
}
CONTEXT_FREE_KINDS = frozenset({"ebnf"})


@dataclass(frozen=True)
class RoutedBackend:
    """A `GrammarBackend` that hands each spec to `regular` or, for context-free kinds,
    to `context_free` (None, with `context_free_error` saying why, when the tokenizer
    cannot drive llguidance). A compiled grammar goes back to the backend whose
    fingerprint it carries."""

    regular: GrammarBackend
    context_free: GuidanceBackend | None
    context_free_error: str = ""
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        parts = [self.regular.fingerprint, self.context_free.fingerprint if self.context_free else ""]
        object.__setattr__(self, "fingerprint", hashlib.sha256(":".join(parts).encode()).hexdigest())

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, logits_width: int | None = None,
                       regular: str = "outlines") -> RoutedBackend:
        """`regular`: a key of `REGULAR_BACKENDS`."""
        if regular not in REGULAR_BACKENDS:
            raise ValueError(f"grammar backend must be one of {sorted(REGULAR_BACKENDS)}; got {regular!r}")
        try:
            context_free = GuidanceBackend.from_tokenizer(tokenizer, logits_width=logits_width)
        except ValueError as e:
            if regular == "llguidance":
                raise
            return cls(REGULAR_BACKENDS[regular](tokenizer, logits_width=logits_width), None, str(e))
        if regular == "llguidance":
            return cls(context_free, context_free)
        return cls(REGULAR_BACKENDS[regular](tokenizer, logits_width=logits_width), context_free)

    def _for_spec(self, spec: GrammarSpec) -> GrammarBackend:
        if spec.kind not in CONTEXT_FREE_KINDS:
            return self.regular
        if self.context_free is None:
            raise ValueError(f"{spec.kind} grammars cannot be enforced: {self.context_free_error}")
        return self.context_free

    def _owner(self, compiled: CompiledGrammar) -> GrammarBackend:
        owner = self._for_spec(compiled.spec)
        if compiled.fingerprint != owner.fingerprint:
            raise ValueError("grammar was compiled for a different tokenizer")
        return owner

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self._for_spec(spec).compile(spec)

    def prepare(self, compiled: CompiledGrammar) -> CompiledGrammar:
        return self._owner(compiled).prepare(compiled)

    def matcher(self, compiled: CompiledGrammar, *, stop_token_ids: Iterable[int] | None = None,
                max_rollback: int = 64) -> Grammar:
        return self._owner(compiled).matcher(compiled, stop_token_ids=stop_token_ids, max_rollback=max_rollback)
