"""Constrained decoding inside the scheduler: compiling off the critical path, masking
each constrained row's logits, advancing each request's grammar on its sampled token."""

from __future__ import annotations

from concurrent.futures import Future, wait

import torch

from sprig.kernels.logit_mask import apply_token_bitmask
from sprig.runtime.constrained import (
    CompilerConfig,
    FreeGrammar,
    Grammar,
    GrammarCompiler,
    GrammarTimeoutError,
    RoutedBackend,
    bitmask_width,
    spec_from_params,
)
from sprig.runtime.scheduler.marker import Marker
from sprig.runtime.scheduler.reasoning_gate import Markers, ReasoningGate
from sprig.runtime.scheduler.request import Req
from sprig.runtime.scheduler.trigger_gate import TriggerGate

GRAMMAR_ERROR = "invalid grammar"  # how a grammar that fails to compile is reported


class GrammarError(ValueError):
    """A request's regex or schema cannot be compiled or enforced (the client's fault)."""


class Grammars:
    """Owns the grammar backend and compiler, created on the first constrained request
    (no compile workers exist for an engine that never sees one)."""

    def __init__(self, tokenizer, logits_width: int, config: CompilerConfig, backend: str = "outlines") -> None:
        """`backend`: what compiles regexes, JSON schemas and choices (`RoutedBackend`)."""
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self.config = config
        self.backend_name = backend
        self._backend: RoutedBackend | None = None
        self._compiler: GrammarCompiler | None = None
        self._pending: dict[str, Future] = {}
        self._markers: dict[tuple[str | None, str, tuple[str, ...]], Markers] = {}
        self._triggers: dict[str, Marker] = {}

    def submit(self, req: Req) -> None:
        """Start compiling `req`'s grammar, if it asks for one; a request with a thinking
        budget and no constraint gets its gate over a `FreeGrammar` at once (no stop token
        is held back while it thinks: nothing is owed after it). Raises `GrammarError` for
        a spec that is malformed on its face."""
        try:
            spec = spec_from_params(req.params)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        if spec is None:
            if req.params.thinking_budget is not None:
                if self.tokenizer is None:
                    raise GrammarError("a thinking budget needs the scheduler to have a tokenizer")
                req.grammar = self._gated(FreeGrammar(), req, frozenset())
            return
        if self._compiler is None:
            if self.tokenizer is None:
                raise GrammarError("constrained decoding needs the scheduler to have a tokenizer")
            self._backend = RoutedBackend.from_tokenizer(self.tokenizer, logits_width=self.logits_width,
                                                         regular=self.backend_name)
            self._compiler = GrammarCompiler(self._backend, self.config)
        self._pending[req.rid] = self._compiler.submit(spec)

    def ready(self, req: Req, stop_ids: frozenset[int]) -> bool:
        """True once `req` may run (its grammar compiled, or it has none). Raises
        `GrammarError` if compiling failed."""
        future = self._pending.get(req.rid)
        if future is None:
            return True
        try:
            compiled = GrammarCompiler.poll(future)
        except (ValueError, GrammarTimeoutError) as e:
            del self._pending[req.rid]
            raise GrammarError(f"{GRAMMAR_ERROR}: {e}") from None
        if compiled is None:
            return False
        del self._pending[req.rid]
        req.grammar = self._gated(self._backend.matcher(compiled, stop_token_ids=stop_ids), req, stop_ids)
        return True

    def _gated(self, grammar: Grammar, req: Req, stop_ids: frozenset[int]) -> Grammar:
        """`grammar`, deferred past its trigger and past the reasoning when the request's
        params name them (the trigger is looked for in the answer, after the reasoning)."""
        trigger = req.params.constraint_trigger
        if trigger is not None:
            if trigger not in self._triggers:
                self._triggers[trigger] = Marker.build(self.tokenizer, trigger)
            grammar = TriggerGate(grammar, self._triggers[trigger], stop_token_ids=stop_ids, tokenizer=self.tokenizer)
        start, end = req.params.reasoning_start, req.params.reasoning_end
        if end is None:
            return grammar
        key = (start, end, req.params.reasoning_exits)
        if key not in self._markers:
            self._markers[key] = Markers.build(self.tokenizer, *key)
        return ReasoningGate(grammar, self._markers[key], opens_inside=start is None,
                             stop_token_ids=stop_ids, tokenizer=self.tokenizer, budget=req.params.thinking_budget)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def forget(self, rid: str) -> None:
        future = self._pending.pop(rid, None)
        if future is not None:
            future.cancel()

    def wait_any(self, timeout: float) -> None:
        """Block until some compile finishes or `timeout` seconds pass."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when="FIRST_COMPLETED")

    def mask(self, reqs: list[Req], logits: torch.Tensor,
             given: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """`logits` with every constrained row limited to its grammar's allowed tokens
        (a copy when any row is limited): row i's bitmask is `given[i]` where that is
        set (a speculative verification's row past the request's grammar state), else the
        grammar's own, unless that allows every token (`Grammar.allows_all`: a thinking
        budget's gate while it closes nothing)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None
                and ((given is not None and given[i] is not None) or not r.grammar.allows_all())]
        if not rows:
            return logits
        bitmask = torch.zeros(len(rows), bitmask_width(logits.shape[-1]), dtype=torch.int32)
        for j, i in enumerate(rows):
            if given is not None and given[i] is not None:
                bitmask[j] = given[i]
            else:
                reqs[i].grammar.fill_bitmask(bitmask[j])
        masked = logits.clone()
        apply_token_bitmask(masked, bitmask.to(logits.device), rows=torch.tensor(rows, device=logits.device))
        return masked

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._compiler is not None:
            self._compiler.close()
