"""Constrained decoding: regex / JSON-schema / choice / EBNF grammars as per-step token bitmasks.

Scheduler use: `RoutedBackend.from_tokenizer(tok, logits_width=V)` once;
`GrammarCompiler(backend)`; per request `future = compiler.submit(spec)` and, each step
until `compiler.poll(future)` returns it, keep the request waiting; then
`grammar = backend.matcher(compiled, stop_token_ids=...)` and per decode step
`grammar.fill_bitmask(row)` → mask logits → sample → `grammar.accept_token(t)`.
"""

from sprig.runtime.constrained.base import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarSpec,
    GrammarTimeoutError,
    bitmask_width,
    spec_from_params,
)
from sprig.runtime.constrained.compiler import CompilerConfig, GrammarCompiler
from sprig.runtime.constrained.free import FreeGrammar
from sprig.runtime.constrained.guidance_backend import GuidanceBackend
from sprig.runtime.constrained.outlines_backend import OutlinesBackend
from sprig.runtime.constrained.routing import REGULAR_BACKENDS, RoutedBackend
from sprig.runtime.constrained.vocabulary import TokenVocabulary, build_vocabulary

__all__ = [
    "GRAMMAR_KINDS",
    "REGULAR_BACKENDS",
    "CompiledGrammar",
    "CompilerConfig",
    "FreeGrammar",
    "Grammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarSpec",
    "GrammarTimeoutError",
    "GuidanceBackend",
    "OutlinesBackend",
    "RoutedBackend",
    "TokenVocabulary",
    "bitmask_width",
    "build_vocabulary",
    "spec_from_params",
]
