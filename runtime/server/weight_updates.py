"""Weight updates in the scheduler process (`/update_weights_from_disk`), one at a time,
in the order messages arrive.

An update waits for every request that arrived before it to finish (or aborts them, with
`abort_all_requests`; while generation is paused, for none: a pause by retraction or abort
leaves no request holding K/V, and those waiting run on the new weights once generation
continues; a pause in place that leaves requests holding K/V refuses updates), has the model runner load the new weights on a worker thread while
the loop goes on sending heartbeats, then drops the radix cache
(`Scheduler.weights_loaded`); requests, and control requests about the weights, that
arrive in the meantime are held and handled afterwards, in order. So every request runs on
one set of weights: those in place when it arrived, after any update sent before it. Its
responses carry their label (`meta_info["weight_version"]`).

Phases: idle; pending (the update waits for the scheduler to empty; requests, control
requests about the weights and pausing (`UPDATE_KINDS`) and aborts of held requests are
held, other messages are handled); loading (every message is held: the loop touches nothing the worker
thread uses).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from sprig.runtime.model_runner import WeightUpdateError
from sprig.runtime.request_contract import TokenizedRequest
from sprig.runtime.scheduler.scheduler import Scheduler
from sprig.runtime.weight_update import update_message
from sprig.runtime.wire import AbortReq, ControlReply, ControlReq

log = logging.getLogger("sprig.scheduler")
# control requests about the weights: while an update is in progress they wait their turn
UPDATE_KINDS = ("update_weights", "update_weight_version", "get_weights_by_name", "pause_generation",
                "continue_generation")


class WeightUpdates:
    """The scheduler loop's weight updates. `send_http` answers each with a `ControlReply`:
    ok with `{"message", "num_paused_requests", "model_path", "weight_version"}`, or not ok
    with `{"message"}` (the old weights in place). An exception other than
    `WeightUpdateError` (the weights could not be restored, the tensor-parallel group
    failed) propagates from `advance`: the process cannot serve."""

    def __init__(self, scheduler: Scheduler, send_http: Callable[[object], None]) -> None:
        self.scheduler = scheduler
        self.send_http = send_http
        self.pending: ControlReq | None = None
        self.held: list[object] = []
        self._loading: Future[None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sprig-weights")

    @property
    def active(self) -> bool:
        return self.pending is not None

    @property
    def held_requests(self) -> int:
        """Requests waiting for the update in progress."""
        return sum(isinstance(m, TokenizedRequest) for m in self.held)

    def hold(self, msg: object) -> bool:
        """Hold `msg` if it must wait for the update in progress; False to handle it now."""
        if self.pending is None:
            return False
        if self._loading is None and not self._waits(msg):
            return False
        self.held.append(msg)
        return True

    def _waits(self, msg: object) -> bool:
        if isinstance(msg, TokenizedRequest):
            return True
        if isinstance(msg, ControlReq):
            return msg.kind in UPDATE_KINDS
        if isinstance(msg, AbortReq):
            return any(isinstance(m, TokenizedRequest) and m.rid == msg.rid for m in self.held)
        return False

    def start(self, msg: ControlReq) -> None:
        """Begin the update `msg` asks for (none is in progress)."""
        self.pending = msg
        log.info("updating the weights from %s once the %d requests in flight finish; holding new requests",
                 msg.args["model_path"], len(self.scheduler.running) + len(self.scheduler.waiting))

    def advance(self) -> list[object]:
        """Move the update on: start loading once the scheduler is empty; once loaded,
        answer it and return the held messages, for the loop to handle in order."""
        msg = self.pending
        if msg is None:
            return []
        if self._loading is None:
            if self.scheduler.has_work or self.scheduler.holds_kv:  # paused in place: wait for the requests
                return []
            self._loading = self._pool.submit(self.scheduler.runner.update_weights, msg.args["model_path"])
            return []
        if not self._loading.done():
            return []
        paused = self.held_requests
        version = msg.args.get("weight_version")
        try:
            self._loading.result()
        except WeightUpdateError as e:
            log.warning("weight update failed: %s", e)
            self.scheduler.weights_loaded(None)
            self.send_http(ControlReply(msg.token, False, {"message": str(e)}))
        else:
            self.scheduler.weights_loaded(version)
            self.send_http(ControlReply(msg.token, True, {
                "message": update_message(version),
                "num_paused_requests": paused,
                "model_path": str(self.scheduler.runner.config.model_path),
                "weight_version": self.scheduler.weight_version,
            }))
        finally:
            self.pending, self._loading = None, None
        released, self.held = self.held, []
        return released

    def close(self) -> None:
        self._pool.shutdown(wait=True)
