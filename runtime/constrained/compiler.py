"""The grammar compile service: a non-blocking, deduplicated, byte-bounded compile cache.

The scheduler calls `submit(spec)` when a constrained request arrives and `poll(future)`
each step; the request waits (without blocking the batch) until its grammar is ready.
Compiles run on a small thread pool, each thread driving one worker process
(`worker.CompileWorker`), so a pathological pattern is killed at `timeout_s` and its
request fails with `GrammarTimeoutError` instead of wedging the server. The same thread
then runs the backend's `prepare` on the result, in this process.

Slow patterns cannot starve the others: a first attempt gets `slow_after_s`; one still
running then is killed and compiled again in a lane of its own (one worker), up to
`timeout_s`. The pool's workers stay free for ordinary grammars however many slow ones
arrive; slow ones wait for each other.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from sprig.runtime.constrained.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarSpec,
    GrammarTimeoutError,
)
from sprig.runtime.constrained.worker import CompileWorker

# In-memory size of an outlines-core index over its pickled size (measured: ~3.3).
_MEMORY_PER_PICKLED_BYTE = 4
# What a cached grammar counts as at least: an llguidance grammar pickles to its text, a
# few KB, while its prepared matcher holds lexer tables.
_MIN_MEMORY_BYTES = 1 << 20
_Key = tuple[str, GrammarSpec]


@dataclass(frozen=True)
class CompilerConfig:
    """`timeout_s`: longest one compile may run; `slow_after_s`: how long a first attempt
    may run before it moves to the slow lane; `num_workers`: concurrent first attempts
    (default: one per core, at least two); `worker_memory_bytes`: address-space cap of
    each worker process; `cache_bytes`: bound on the estimated memory of cached
    grammars; `max_cached_errors`: how many failed specs are remembered (so a repeat,
    a timed-out one included, fails at once)."""

    timeout_s: float = 30.0
    slow_after_s: float = 2.0
    num_workers: int = field(default_factory=lambda: max(2, os.cpu_count() or 2))
    worker_memory_bytes: int = 8 << 30
    cache_bytes: int = 2 << 30
    max_cached_errors: int = 1024

    def __post_init__(self) -> None:
        for name in (f.name for f in fields(self)):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)!r}")


def _settled(result: CompiledGrammar | None = None, error: Exception | None = None) -> Future:
    future: Future = Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future


class GrammarCompiler:
    """Invariants: at most one compile in flight per key (backend fingerprint, spec), and
    every caller of that key shares its future; a compiled grammar stays cached until
    evicted least-recently-used when the estimated total passes `cache_bytes`; invalid
    and timed-out specs are remembered as errors; `submit` never waits for a compile.
    """

    def __init__(self, backend: GrammarBackend, config: CompilerConfig | None = None) -> None:
        self.config = config or CompilerConfig()
        self.compiles_started = 0
        self._fingerprint = backend.fingerprint
        self._backend = backend
        self._payload = pickle.dumps(backend, protocol=pickle.HIGHEST_PROTOCOL)
        self._threads = ThreadPoolExecutor(self.config.num_workers, "sprig-grammar")
        self._slow_lane = ThreadPoolExecutor(1, "sprig-grammar-slow")
        self._lock = threading.Lock()
        self._idle: list[CompileWorker] = []
        self._cache: OrderedDict[_Key, tuple[CompiledGrammar, int]] = OrderedDict()
        self._cached_bytes = 0
        self._errors: OrderedDict[_Key, Exception] = OrderedDict()
        self._inflight: dict[_Key, Future] = {}
        self._closed = False

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar; raises on it `ValueError` (invalid spec, or
        out of memory), `GrammarTimeoutError`, or `RuntimeError` (a bug in a backend)."""
        key = (self._fingerprint, spec)
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            if key in self._cache:
                self._cache.move_to_end(key)
                return _settled(self._cache[key][0])
            if key in self._errors:
                return _settled(error=self._errors[key])
            if key in self._inflight:
                return self._inflight[key]
            future: Future = Future()
            future.set_running_or_notify_cancel()  # shared: no caller may cancel it
            self._inflight[key] = future
            self.compiles_started += 1
        self._threads.submit(self._compile, key, future)
        return future

    @staticmethod
    def poll(future: Future) -> CompiledGrammar | None:
        """The compiled grammar if ready, None if still compiling; raises its error."""
        return future.result() if future.done() else None

    def get(self, spec: GrammarSpec, timeout: float | None = None) -> CompiledGrammar:
        """Blocking `submit(spec).result()`, for offline use."""
        return self.submit(spec).result(timeout)

    def _compile(self, key: _Key, future: Future, *, slow: bool = False) -> None:
        """Compile `key` and settle `future`; a first attempt (not `slow`) that outlasts
        `slow_after_s` is handed to the slow lane instead."""
        first_limit = min(self.config.slow_after_s, self.config.timeout_s)
        try:
            if self._closed:
                raise RuntimeError("the grammar compiler was closed")
            compiled, pickled_bytes = self._run(key[1], self.config.timeout_s if slow else first_limit)
            compiled = self._backend.prepare(compiled)
        except GrammarTimeoutError:
            if not slow and first_limit < self.config.timeout_s:
                try:
                    self._slow_lane.submit(self._compile, key, future, slow=True)
                except RuntimeError:  # closed meanwhile
                    self._fail(key, future, RuntimeError("the grammar compiler was closed"))
                return
            self._fail(key, future, GrammarTimeoutError(
                f"compiling the {key[1].kind} grammar took longer than {self.config.timeout_s:g} s"))
            return
        except Exception as e:
            self._fail(key, future, e)
            return
        with self._lock:
            del self._inflight[key]
            self._insert(key, compiled, max(pickled_bytes * _MEMORY_PER_PICKLED_BYTE, _MIN_MEMORY_BYTES))
        future.set_result(compiled)

    def _fail(self, key: _Key, future: Future, e: Exception) -> None:
        with self._lock:
            del self._inflight[key]
            if isinstance(e, (ValueError, GrammarTimeoutError)):
                self._errors[key] = e
                while len(self._errors) > self.config.max_cached_errors:
                    self._errors.popitem(last=False)
        future.set_exception(e)

    def _insert(self, key: _Key, compiled: CompiledGrammar, nbytes: int) -> None:
        if nbytes > self.config.cache_bytes:
            return
        self._cache[key] = (compiled, nbytes)
        self._cached_bytes += nbytes
        while self._cached_bytes > self.config.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self._cached_bytes -= evicted

    def _run(self, spec: GrammarSpec, timeout_s: float) -> tuple[CompiledGrammar, int]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or CompileWorker(self._payload, self.config.worker_memory_bytes)
        try:
            return worker.compile(spec, timeout_s)
        finally:
            with self._lock:
                keep = worker.alive and not self._closed
                if keep:
                    self._idle.append(worker)
            if not keep:
                worker.kill()

    def close(self) -> None:
        """Stop the workers; a running compile finishes, queued ones fail."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()
        self._threads.shutdown(wait=False)
        self._slow_lane.shutdown(wait=False)

    def __enter__(self) -> GrammarCompiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
