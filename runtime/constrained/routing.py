"""Which backend compiles which kind of grammar.

Context-free grammars (`ebnf`) go to llguidance, the one backend here that parses them.
Regexes, JSON schemas and choices go to the backend `regular` names; both compile them
to the same regex (`spec_regex`), so they enforce the same outputs, at different costs
(`benchmarks/bench_grammar_backends.py`; RESULTS.md has a run): outlines-core computes a
token automaton up front (slow to compile, seconds for a large schema over a large
vocabulary; cheap masks), llguidance computes masks lazily (compiles in milliseconds;
each mask costs more).

JSON schemas with free-form JSON in them (`admits_free_form`: `response_format`'s
`json_object`, a `{}` or annotation-only property, an object with no properties, an
array with no items) go to llguidance whatever `regular` is, where the tokenizer can drive
it: their regex spells out any JSON value, and outlines-core takes 6 s (an array), 9 s
(`json_object`) and 152 s (`{}`, past the default compile timeout) to build its automaton
over a 32k vocabulary on 2 CPU cores, llguidance 0.01-0.05 s
(`benchmarks/bench_grammar_backends.py --free-form`). The choice is a function of the
spec alone, so a request is enforced the same way on every run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.constrained.base import CompiledGrammar, Grammar, GrammarBackend, GrammarSpec
from sprig.runtime.constrained.guidance_backend import GuidanceBackend
from sprig.runtime.constrained.json_schema import admits_free_form
from sprig.runtime.constrained.outlines_backend import OutlinesBackend

REGULAR_BACKENDS: dict[str, Callable[..., GrammarBackend]] = {
    "outlines": OutlinesBackend.from_tokenizer,
    "llguidance": GuidanceBackend.from_tokenizer,
}
CONTEXT_FREE_KINDS = frozenset({"ebnf"})


@dataclass(frozen=True)
class RoutedBackend:
    """A `GrammarBackend` that hands each spec to `regular` or, for context-free kinds
    and JSON schemas with free-form JSON, to `context_free` (None, with
    `context_free_error` saying why, when the tokenizer cannot drive llguidance: then
    free-form schemas stay on `regular`). A compiled grammar goes back to the backend
    whose fingerprint it carries."""

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
        """The backend that compiles `spec` (asked in the compile worker only: looking
        for free-form JSON walks the schema)."""
        if spec.kind in CONTEXT_FREE_KINDS:
            if self.context_free is None:
                raise ValueError(f"{spec.kind} grammars cannot be enforced: {self.context_free_error}")
            return self.context_free
        if self.context_free is not None and spec.kind == "json_schema" and admits_free_form(spec.text):
            return self.context_free
        return self.regular

    def _owner(self, compiled: CompiledGrammar) -> GrammarBackend:
        """The backend that compiled `compiled`, by the fingerprint it carries."""
        for backend in (self.regular, self.context_free):
            if backend is not None and compiled.fingerprint == backend.fingerprint:
                return backend
        raise ValueError("grammar was compiled for a different tokenizer")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        return self._for_spec(spec).compile(spec)

    def prepare(self, compiled: CompiledGrammar) -> CompiledGrammar:
        return self._owner(compiled).prepare(compiled)

    def matcher(self, compiled: CompiledGrammar, *, stop_token_ids: Iterable[int] | None = None,
                max_rollback: int = 64) -> Grammar:
        return self._owner(compiled).matcher(compiled, stop_token_ids=stop_token_ids, max_rollback=max_rollback)
