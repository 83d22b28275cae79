"""The HTTP process's side of the pipeline: submit sequences to the scheduler, gather
their detokenized outputs per rid, watch the child processes.

Invariants:
- every tracked rid ends, promptly, in exactly one of: a finished output, a
  `RequestError`, or `RequestFailed` raised to its caller because a child died;
- a `Call` whose consumer stops early (client gone) aborts its unfinished sequences in
  the scheduler, so their KV slots are freed;
- sequences in flight (tracked, or aborted and not yet confirmed by the scheduler) never
  exceed `max_inflight`, the scheduler's own queue bound: a call is admitted whole or
  answered 429 whole, so the scheduler never refuses a sequence for room, and nothing
  runs that its client was told failed;
- nothing here blocks the event loop: the socket to the scheduler has no send limit (the
  bound above holds its queue), so a send, an abort included, never fails or waits;
- a child that exits, or sends no `Heartbeat` for `watchdog_timeout` seconds (stuck, or
  stopped: then it is killed at once, since it would not act on SIGTERM), is fatal: every
  request fails with 503, /health answers 503, and `on_fatal(message)` is called
  `FATAL_EXIT_GRACE_S` later (the launcher then exits non-zero).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from sprig.runtime.request_contract import TokenizedRequest
from sprig.runtime.response import ResponseState
from sprig.runtime.server.ipc import IpcPaths, pull_socket, push_socket
from sprig.runtime.server.metrics import Metrics
from sprig.runtime.wire import (
    AbortReq,
    ControlReply,
    ControlReq,
    DetokenizedBatch,
    DetokenizedOutput,
    Heartbeat,
    RequestError,
    StatsReport,
    decode,
    encode,
)

log = logging.getLogger("sprig.server")
FATAL_EXIT_GRACE_S = 1.0  # a fatal error is answered this long before the server exits
WATCHDOG_POLL_S = 1.0


class RequestFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Track:
    """One sequence in flight: its response so far, the outputs its caller has not seen
    yet (`fresh`), and where to signal updates."""

    index: int
    state: ResponseState
    updates: asyncio.Queue[str | None]
    client: int | None  # the API key it was sent with (`app.client_of`)
    created: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    error: RequestFailed | None = None
    fresh: list[DetokenizedOutput] = field(default_factory=list)


@dataclass(frozen=True)
class Update:
    """What one sequence of a call received since its last update: `outputs`, the deltas
    in order (what the OpenAI routes stream), and `state`, the cumulative response
    (SGLang's `/generate` schema). `state` keeps growing after the update is handed
    out: snapshot it before awaiting anything."""

    index: int
    outputs: list[DetokenizedOutput]
    state: ResponseState


class Call:
    """The sequences of one HTTP request, in output order."""

    def __init__(self, manager: RequestManager, reqs: list[TokenizedRequest], client: int | None) -> None:
        self.manager = manager
        self.rids = [r.rid for r in reqs]
        self.updates: asyncio.Queue[str | None] = asyncio.Queue()  # None: the client is gone
        self.tracks = {
            r.rid: _Track(i, ResponseState(r.rid, len(r.prompt_ids), return_logprob=r.logprobs.return_logprob,
                                          token_ids_logprob=bool(r.logprobs.token_ids_logprob), embed=r.embed),
                         self.updates, client)
            for i, r in enumerate(reqs)
        }

    async def stream(self, client_gone: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[Update]:
        """Yield an `Update` whenever sequences receive outputs, until every sequence
        finished; the last update of an index holds its final output. Raises
        `RequestFailed` on the first error; returns early once `client_gone()` returns
        (it is awaited beside the updates). Unfinished sequences are aborted however this
        ends."""
        pending = set(self.rids)
        watch = asyncio.create_task(self._watch(client_gone)) if client_gone is not None else None
        try:
            while pending:
                first = await self.updates.get()
                rids = dict.fromkeys([first, *(self.updates.get_nowait() for _ in range(self.updates.qsize()))])
                if None in rids:
                    log.info("client disconnected; aborting %d sequences", len(pending))
                    return
                for rid in rids:
                    track = self.tracks[rid]
                    if track.error is not None:
                        raise track.error
                    if not track.fresh:
                        continue
                    if track.state.finished:
                        pending.discard(rid)
                    outputs, track.fresh = track.fresh, []
                    yield Update(track.index, outputs, track.state)
        finally:
            if watch is not None:
                watch.cancel()
            self.close()

    async def _watch(self, client_gone: Callable[[], Awaitable[None]]) -> None:
        await client_gone()
        self.updates.put_nowait(None)

    async def collect(self, client_gone: Callable[[], Awaitable[None]] | None = None) -> list[dict[str, Any]]:
        """Every sequence's final response, in order."""
        async for _ in self.stream(client_gone):
            pass
        if not all(self.tracks[rid].state.finished for rid in self.rids):
            raise RequestFailed(499, "client disconnected")
        return self.responses()

    def responses(self) -> list[dict[str, Any]]:
        """Every sequence's response so far, in order."""
        return [self.tracks[rid].state.response for rid in self.rids]

    def close(self) -> None:
        """Abort what is unfinished and stop tracking. Idempotent; never awaits."""
        for rid, track in self.tracks.items():
            if self.manager.tracks.pop(rid, None) is not None and not track.state.finished and track.error is None:
                self.manager.abort_untracked(rid)


@dataclass
class ServedWeights:
    """The checkpoint whose weights the scheduler runs, and their label: changed when the
    scheduler's reply to a weight update (or a new label) says it succeeded; and the LoRA
    adapters loaded (name -> path), as the scheduler's last answer about them said."""

    model_path: str
    weight_version: str
    adapters: dict[str, str] = field(default_factory=dict)


class RequestManager:
    """Owns the sockets to the scheduler (send) and from both children (receive)."""

    def __init__(self, ipc: IpcPaths, children: dict[str, BaseProcess], metrics: Metrics, max_inflight: int,
                 watchdog_timeout: float, on_fatal: Callable[[str], None] | None = None, *,
                 weights: ServedWeights) -> None:
        self.ipc = ipc
        self.weights = weights
        self.pending_updates = 0  # weight updates sent and not answered (`routes_weights` bounds them)
        self.paused: str | None = None  # the pause in effect, as the scheduler's last pause/continue reply said
        self.children = children
        self.metrics = metrics
        self.max_inflight = max_inflight
        self.watchdog_timeout = watchdog_timeout
        self.on_fatal = on_fatal
        self.heartbeats: dict[str, float] = {}  # child name -> when its last heartbeat arrived
        self.tracks: dict[str, _Track] = {}
        self.aborting: set[str] = set()  # aborted by a client's leaving, until the scheduler confirms
        self.dead: str | None = None
        self.stats: StatsReport | None = None
        self._controls: dict[int, asyncio.Future[ControlReply]] = {}
        self._tokens = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._push = push_socket(self._ctx, self.ipc.scheduler, unbounded=True)
        self._pull = pull_socket(self._actx, self.ipc.http)
        self._tasks.append(asyncio.create_task(self._receive_loop()))
        now = time.monotonic()
        self.heartbeats = {name: now for name in self.children}
        self._tasks.append(asyncio.create_task(self._watchdog()))
        loop = asyncio.get_running_loop()
        for name, proc in self.children.items():
            loop.add_reader(proc.sentinel, self._child_exited, name, proc)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self.children.values():
            loop.remove_reader(proc.sentinel)
        for task in self._tasks:
            task.cancel()
        self._push.close()
        self._pull.close()
        self._ctx.term()

    # ------------------------------------------------------------------ sending
    def send(self, msg: object) -> None:
        """Queue `msg` for the scheduler; never blocks (the socket has no send limit)."""
        self._push.send(encode(msg), zmq.NOBLOCK)

    def check_room(self, n: int) -> None:
        """Raise unless `n` more sequences may start: 503 if a child died, 400 if `n` is
        past the bound itself, 429 (retry later) if the sequences in flight leave no room."""
        if self.dead:
            raise RequestFailed(503, self.dead)
        if n > self.max_inflight:
            raise RequestFailed(400, f"a request may hold at most {self.max_inflight} sequences (prompts x n); it has {n}")
        if len(self.tracks) + len(self.aborting) + n > self.max_inflight:
            raise RequestFailed(
                429, f"the server has {self.max_inflight} sequences in flight at most and no room for {n} more; retry later"
            )

    def submit(self, reqs: list[TokenizedRequest], client: int | None) -> Call:
        """Track and send every sequence of one call (all or none), sent with API key `client`;
        the requests were built by the request contract (their rids distinct)."""
        self.check_room(len(reqs))
        if taken := [r.rid for r in reqs if r.rid in self.tracks]:
            raise RequestFailed(400, f"request id {taken[0]!r} is already in use")
        call = Call(self, reqs, client)
        self.tracks.update(call.tracks)
        for r in reqs:
            self.send(r)
        self.metrics.requests_received.inc(len(reqs))
        return call

    def abort_untracked(self, rid: str) -> None:
        """Abort a sequence whose client left; it counts as in flight until the scheduler
        confirms it ended (a finished output or an error)."""
        self.aborting.add(rid)
        self.send(AbortReq(rid))
        self.metrics.requests_finished.labels("abort").inc()

    def abort(self, rid: str, client: int | None) -> bool:
        """Abort `rid` or, for n > 1, every `rid-j`, if sent with the same API key;
        False if none such is in flight."""
        found = [
            r for r, track in self.tracks.items()
            if track.client == client and (r == rid or (r.startswith(f"{rid}-") and r[len(rid) + 1 :].isdigit()))
        ]
        for r in found:
            self.send(AbortReq(r))
        return bool(found)

    async def control(self, kind: str, args: dict[str, Any] | None = None,
                      timeout: float | None = 10.0) -> ControlReply:
        """The scheduler's reply to control request `kind` (`ControlReq`); 503 if it does not
        come within `timeout` seconds (None: it comes, or the scheduler dies: 503 too)."""
        if self.dead:
            raise RequestFailed(503, self.dead)
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        self._controls[token] = future
        try:
            self.send(ControlReq(token, kind, args or {}))
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise RequestFailed(503, f"the scheduler did not answer {kind} within {timeout:g} s") from None
        finally:
            self._controls.pop(token, None)

    # ------------------------------------------------------------------ receiving
    async def _receive_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                self._dispatch(decode(data))
            except Exception:
                log.exception("failed to handle a message from a child process")

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, DetokenizedBatch):
            now = time.monotonic()
            for out in msg.outputs:
                track = self.tracks.get(out.rid)
                if track is None:
                    if out.finish_reason is not None:
                        self.aborting.discard(out.rid)
                    continue
                track.state.add(out, now - track.created)
                track.fresh.append(out)
                self.metrics.observe_tokens(track.created, track.last_token, now, len(out.new_ids))
                if out.new_ids:
                    track.last_token = now
                if out.finish_reason is not None:
                    self.metrics.observe_finished(out.finish_reason, now - track.created, out.retractions)
                track.updates.put_nowait(out.rid)
        elif isinstance(msg, RequestError):
            self.aborting.discard(msg.rid)
            track = self.tracks.get(msg.rid)
            if track is not None:
                self._fail(track, msg.rid, RequestFailed(msg.status, msg.message))
                self.send(AbortReq(msg.rid))  # in case a later stage failed: free its slots
        elif isinstance(msg, Heartbeat):
            self.heartbeats[msg.name] = time.monotonic()
        elif isinstance(msg, StatsReport):
            self.stats = msg
            self.metrics.observe_stats(msg)
        elif isinstance(msg, ControlReply):
            if msg.ok and "weight_version" in msg.data:  # whether or not the client still waits
                self.weights.weight_version = msg.data["weight_version"]
                self.weights.model_path = msg.data.get("model_path", self.weights.model_path)
            if msg.ok and "paused" in msg.data:
                self.paused = msg.data["paused"]
            future = self._controls.get(msg.token)
            if future is not None and not future.done():
                future.set_result(msg)

    def _fail(self, track: _Track, rid: str, error: RequestFailed) -> None:
        if track.error is None and not track.state.finished:
            track.error = error
            self.metrics.requests_finished.labels("error").inc()
            track.updates.put_nowait(rid)

    def _child_exited(self, name: str, proc: BaseProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(0.1)  # the sentinel fires as the child exits; reap it for its exit code
        self._fatal(f"the {name} process (pid {proc.pid}) exited with code {proc.exitcode}; the server cannot serve")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_POLL_S)
            now = time.monotonic()
            for name, last in self.heartbeats.items():
                if now - last > self.watchdog_timeout:
                    child = self.children[name]
                    self._fatal(f"the {name} process (pid {child.pid}) has shown no sign of life for "
                                f"{now - last:.0f} s (stuck or stopped); the server cannot serve")
                    child.kill()  # a stopped or stuck process would not act on the launcher's SIGTERM
                    return

    def _fatal(self, message: str) -> None:
        """A child is gone or stuck: fail everything, answer 503 from now on, then exit."""
        if self.dead is not None:
            return
        self.dead = message
        self.aborting.clear()
        log.error("%s; failing %d requests in flight", message, len(self.tracks))
        for rid, track in list(self.tracks.items()):
            self._fail(track, rid, RequestFailed(503, message))
        for future in self._controls.values():
            if not future.done():
                future.set_exception(RequestFailed(503, message))
        if self.on_fatal is not None:
            asyncio.get_running_loop().call_later(FATAL_EXIT_GRACE_S, self.on_fatal, message)
