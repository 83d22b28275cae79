"""Weight updates in the scheduler process (`/update_weights_from_disk`,
`/update_weights_from_distributed`) and the calls that join or leave a weight-update
group, one at a time, in the order messages arrive.

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
thread uses). A group call (`GROUP_CALLS`) goes the same way, since under tensor
parallelism it speaks to the other ranks over the channel steps use; it leaves the
weights and the radix cache as they are. Every job is checked (`check`) before it joins
the queue: a refusal then costs no wait (but for an update whose tensors the trainer is
broadcasting: it is refused in its turn, once they were received and dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sprig.runtime.request_contract import TokenizedRequest
from sprig.runtime.scheduler.scheduler import Scheduler
from sprig.runtime.weight_update import BroadcastPlan, GroupSpec, update_message
from sprig.runtime.wire import AbortReq, ControlReply, ControlReq

log = logging.getLogger("sprig.scheduler")
# control requests about the weights: while an update is in progress they wait their turn
WEIGHT_CHANGES = ("update_weights", "update_weights_from_distributed")  # jobs that load weights
GROUP_CALLS = ("init_weights_update_group", "destroy_weights_update_group")  # jobs that join or leave a group
JOBS = WEIGHT_CHANGES + GROUP_CALLS
UPDATE_KINDS = (*JOBS, "update_weight_version", "get_weights_by_name", "pause_generation", "continue_generation")


class WeightUpdates:
    """The scheduler loop's weight updates and group calls (`JOBS`). `send_http` answers
    each with a `ControlReply`: ok with `{"message"}`, for an update also
    `"num_paused_requests"` and `"weight_version"` (from disk, `"model_path"` too), or not
    ok with `{"message"}` (the old weights in place; a `WeightUpdateError` or another
    ValueError). Any other exception (the weights could not be restored, the
    tensor-parallel group failed) propagates from `advance`: the process cannot serve."""

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

    def check(self, msg: ControlReq) -> str | None:
        """Why job `msg` is refused at once (nothing joined or received), or None. An update
        whose tensors can be received and dropped waits its turn to be refused then
        (`WeightGroups.update`): the trainer is broadcasting them."""
        groups = self.scheduler.runner.weight_groups
        try:
            if msg.kind == "update_weights_from_distributed":
                groups.check_unreceived(BroadcastPlan.of(msg.args))
            elif msg.kind == "init_weights_update_group":
                groups.check_join(GroupSpec(**msg.args))
            elif msg.kind == "destroy_weights_update_group" and msg.args["group_name"] not in groups.groups:
                return f"group_name {msg.args['group_name']!r}: no weight-update group of that name is joined"
        except ValueError as e:
            return str(e)
        return None

    def start(self, msg: ControlReq) -> None:
        """Begin job `msg` (none is in progress)."""
        self.pending = msg
        what = {"update_weights": f"updating the weights from {msg.args.get('model_path')}",
                "update_weights_from_distributed": f"receiving {len(msg.args.get('names', ()))} tensors over "
                                                   f"group {msg.args.get('group_name')!r}",
                "init_weights_update_group": f"joining group {msg.args.get('group_name')!r}",
                "destroy_weights_update_group": f"leaving group {msg.args.get('group_name')!r}"}[msg.kind]
        log.info("%s once the %d requests in flight finish; holding new requests", what,
                 len(self.scheduler.running) + len(self.scheduler.waiting))

    def _job(self, msg: ControlReq) -> Callable[[], Any]:
        runner, args = self.scheduler.runner, msg.args
        if msg.kind == "update_weights":
            return lambda: runner.update_weights(args["model_path"])
        if msg.kind == "update_weights_from_distributed":
            return lambda: runner.weight_groups.update(BroadcastPlan.of(args))
        if msg.kind == "init_weights_update_group":
            return lambda: runner.weight_groups.join(GroupSpec(**args))
        return lambda: runner.weight_groups.leave(args["group_name"])

    def advance(self) -> list[object]:
        """Move the update on: start loading once the scheduler is empty; once loaded,
        answer it and return the held messages, for the loop to handle in order."""
        msg = self.pending
        if msg is None:
            return []
        if self._loading is None:
            if self.scheduler.has_work or self.scheduler.holds_kv:  # paused in place: wait for the requests
                return []
            self._loading = self._pool.submit(self._job(msg))
            return []
        if not self._loading.done():
            return []
        try:
            result = self._loading.result()
        except ValueError as e:  # a WeightUpdateError, or a group not joined or left
            log.warning("%s failed: %s", msg.kind, e)
            if msg.kind in WEIGHT_CHANGES:
                self.scheduler.weights_loaded(None)
            self.send_http(ControlReply(msg.token, False, {"message": str(e)}))
        else:
            self.send_http(ControlReply(msg.token, True, self._done(msg, result)))
        finally:
            self.pending, self._loading = None, None
        released, self.held = self.held, []
        return released

    def _done(self, msg: ControlReq, result: Any) -> dict[str, Any]:
        """The answer to job `msg`, which returned `result`; an update's weights in place."""
        if msg.kind in GROUP_CALLS:
            return {"message": result}
        version = msg.args.get("weight_version")
        self.scheduler.weights_loaded(version)
        answer = {"num_paused_requests": self.held_requests, "weight_version": self.scheduler.weight_version}
        if msg.kind == "update_weights":
            return {**answer, "message": update_message(version),
                    "model_path": str(self.scheduler.runner.config.model_path)}
        return {**answer, "message": update_message(version, result)}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
