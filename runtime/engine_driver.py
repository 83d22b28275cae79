"""Stepping the offline engine's scheduler for concurrent `Engine.async_generate` calls.

While any call is in flight, one task on the event loop steps the scheduler; the calls'
requests batch together as a server's do. Every touch of the scheduler (adding, aborting,
stepping, flushing the cache, checking integrity) runs on one worker thread, in the order
asked: the event loop never blocks on a model step, and no two threads touch the scheduler
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from sprig.runtime.response import ResponseBuilder
from sprig.runtime.scheduler.request import Req
from sprig.runtime.scheduler.scheduler import Scheduler
from sprig.runtime.wire import TokenOutput

T = TypeVar("T")


def add_all(scheduler: Scheduler, reqs: list[Req]) -> None:
    """Add every one of `reqs` to `scheduler`, or none: if one is refused, those added
    before it are aborted (to be retired by the next step) and the refusal raised."""
    added: list[Req] = []
    try:
        for req in reqs:
            scheduler.add_request(req)
            added.append(req)
    except Exception:
        for req in added:
            scheduler.abort(req.rid)
        raise


@dataclass
class _Call:
    builder: ResponseBuilder
    pending: set[str]
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    start: float = field(default_factory=time.monotonic)
    # rids whose responses grew, then None once every request finished; or the error that ended them
    updates: asyncio.Queue[str | BaseException | None] = field(default_factory=asyncio.Queue)


class EngineDriver:
    """Runs calls' requests on `scheduler` from an event loop. Invariants: a request id is
    owned by the first call that asked for it (`_owners`), from just before its request is
    added until it finishes or that call ends; the stepping task runs while `_owners` is
    not empty or the scheduler has work (aborted requests still to be retired), so the
    scheduler is idle when the task is gone."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sprig-engine")
        self._owners: dict[str, _Call] = {}
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def busy(self) -> bool:
        """Calls are in flight, or requests they left are being retired."""
        return bool(self._owners) or self._task is not None

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the worker thread, after everything asked of it before; blocks."""
        return self._pool.submit(fn).result()

    async def run(self, reqs: list[Req], builder: ResponseBuilder) -> AsyncIterator[str]:
        """Add `reqs` (raising what `Scheduler.add_request` raises, with none of them left
        running), then yield the id of each request whose response in `builder` grew,
        until all have finished. A call that ends early (cancelled, or its iterator closed)
        aborts its requests still running."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        call = _Call(builder, {r.rid for r in reqs})
        for req in reqs:  # a rid another call owns stays its: the scheduler rejects the duplicate
            self._owners.setdefault(req.rid, call)
        try:
            self._ensure_stepping()
            await asyncio.get_running_loop().run_in_executor(self._pool, self._add, reqs)
            while (update := await call.updates.get()) is not None:
                if isinstance(update, BaseException):
                    raise update
                yield update
        finally:
            unfinished = [rid for rid in call.pending if self._owners.get(rid) is call]
            for rid in unfinished:
                del self._owners[rid]
            if unfinished:
                self._pool.submit(self._abort, unfinished)
                self._ensure_stepping()

    def close(self) -> None:
        """Abort every request, end the calls in flight with a RuntimeError and stop the
        worker thread (the engine is shutting down). Safe from any thread."""
        self._closed = True
        self._fail_all(RuntimeError("the engine shut down"))
        self._pool.submit(self._abort_all)
        self._pool.shutdown(wait=True)

    def _fail_all(self, error: Exception) -> None:
        """End every call in flight with `error`, from whatever thread."""
        for call in {id(c): c for c in self._owners.values()}.values():
            if not call.loop.is_closed():
                call.loop.call_soon_threadsafe(call.updates.put_nowait, error)
        self._owners.clear()

    # ------------------------------------------------------------------ worker thread
    def _add(self, reqs: list[Req]) -> None:
        add_all(self.scheduler, reqs)

    def _abort(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.scheduler.abort(rid)

    def _abort_all(self) -> None:
        self._abort([r.rid for r in [*self.scheduler.waiting, *self.scheduler.running]])
        if self.scheduler.chunked is not None:
            self.scheduler.abort(self.scheduler.chunked.rid)
        while self.scheduler.has_work:
            self.scheduler.step()

    def _step(self) -> tuple[list[TokenOutput], bool]:
        return self.scheduler.step(), self.scheduler.has_work

    # ------------------------------------------------------------------ event loop
    def _ensure_stepping(self) -> None:
        if self._task is None:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to step from
                self._task = asyncio.get_running_loop().create_task(self._stepping())

    async def _stepping(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            has_work = True
            while self._owners or has_work:
                outs, has_work = await loop.run_in_executor(self._pool, self._step)
                self._dispatch(outs)
        except BaseException as e:
            if self._closed:  # `close` ended the calls
                return
            self._fail_all(e if isinstance(e, Exception) else RuntimeError("the engine stopped stepping"))
            self._pool.submit(self._abort_all)
            raise
        finally:
            self._task = None

    def _dispatch(self, outs: list[TokenOutput]) -> None:
        now = time.monotonic()
        for out in outs:
            call = self._owners.get(out.rid)
            if call is None:  # its call ended early
                continue
            call.builder.add(out, now - call.start)
            if out.finish_reason is not None:
                call.pending.discard(out.rid)
                del self._owners[out.rid]
            call.updates.put_nowait(out.rid)
            if not call.pending:
                call.updates.put_nowait(None)
