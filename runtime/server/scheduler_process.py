"""The scheduler process: receive requests and aborts, step the scheduler, push tokens.

`SchedulerLoop` holds the logic and takes its outputs as callables, so tests can drive it
in-process; `run_scheduler_process` wires it to ZeroMQ. Invariants:
- every request the HTTP process sends is answered: it either gets a `RequestError`
  (rejected, queue full, failed, or an internal error) or token outputs up to a finished
  one; a finish reason never carries a failure to HTTP;
- a `DetokRegister` for a rid precedes its first `TokenBatch` (same socket, in order);
- an exception never leaves the loop unless recovering from it fails too (then the process
  exits and the HTTP process, which watches it, fails every pending request).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from sprig.runtime.detokenizer import PROMPT_CONTEXT_TOKENS
from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.request_contract import TokenizedRequest
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler.intake import QueueFull, RequestRejected
from sprig.runtime.scheduler.request import Req
from sprig.runtime.scheduler.scheduler import Scheduler, SchedulerStats
from sprig.runtime.server.child import (
    HeartbeatClock,
    ParentWatch,
    leave_orphaned,
    release_free_heap,
    report_startup,
    setup_child,
)
from sprig.runtime.server.ipc import IpcPaths, pull_socket, push_socket
from sprig.runtime.server.stats import StatsTracker
from sprig.runtime.server.weight_updates import JOBS, WEIGHT_CHANGES, WeightUpdates
from sprig.runtime.wire import (
    AbortReq,
    ControlReply,
    ControlReq,
    DetokRegister,
    Forget,
    Heartbeat,
    RequestError,
    StartupReport,
    TokenBatch,
    decode,
    encode,
)

log = logging.getLogger("sprig.scheduler")
Send = Callable[[object], None]
IDLE_CHECK_INTERVAL_S = 2.0  # the idle KV self-check walks the radix tree: not at every idle moment
UPDATE_POLL_S = 0.01  # how often an idle loop looks at a weight update in progress
IN_PLACE_UPDATE = ("requests paused in place hold K/V the current weights computed; pause with mode \"retract\" "
                   "(they resume on the new weights) or \"abort\", or send abort_all_requests, to update the weights")


class SchedulerLoop:
    """One scheduler behind message queues. `live` is every rid accepted and not finished."""

    def __init__(self, scheduler: Scheduler, send_detok: Send, send_http: Send, stats: StatsTracker) -> None:
        self.scheduler = scheduler
        self.send_detok = send_detok
        self.send_http = send_http
        self.stats = stats
        self.live: set[str] = set()
        self.updates = WeightUpdates(scheduler, send_http)
        self._last_idle_check = -IDLE_CHECK_INTERVAL_S
        self._stepped_since_check = False

    # ------------------------------------------------------------------ messages
    def handle(self, msg: object) -> None:
        if self.updates.hold(msg):
            return
        if isinstance(msg, TokenizedRequest):
            self._add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, ControlReq):
            reply = self._control(msg)
            if reply is not None:
                self.send_http(reply)
        else:
            log.error("ignoring unexpected message %s", type(msg).__name__)

    def _add(self, msg: TokenizedRequest) -> None:
        """Queue a request the HTTP process built (and validated: `request_contract`)."""
        params = msg.params
        try:
            req = Req.of(msg)
            self.scheduler.add_request(req)
        except QueueFull as e:
            self.send_http(RequestError(msg.rid, str(e), 503))
            return
        except RequestRejected as e:
            self.send_http(RequestError(msg.rid, str(e), 400))
            return
        except Exception:
            log.exception("could not queue request %s", msg.rid)
            self.send_http(RequestError(msg.rid, "internal error queueing the request (see the server log)", 500))
            return
        self.live.add(msg.rid)
        self.send_detok(
            DetokRegister(
                rid=msg.rid,
                prompt_tail=req.prompt_ids[-PROMPT_CONTEXT_TOKENS:],
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                logprob_text=msg.logprobs.return_text_in_logprobs,
                incremental=msg.stream,
            )
        )

    def _lora(self, msg: ControlReq) -> ControlReply:
        """Load or unload an adapter; the reply carries the adapters loaded afterwards."""
        error = None
        try:
            if msg.kind == "load_lora_adapter":
                self.scheduler.load_lora_adapter(msg.args["lora_name"], msg.args["lora_path"])
            else:
                self.scheduler.unload_lora_adapter(msg.args["lora_name"])
        except ValueError as e:
            error = str(e)
        return ControlReply(msg.token, error is None,
                            {"error_message": error, "loaded_adapters": self.scheduler.lora_adapters()})

    def _control(self, msg: ControlReq) -> ControlReply | None:
        """The reply to `msg`, or None for a weight update (`WeightUpdates` answers it)."""
        if msg.kind in JOBS:
            return self._start_job(msg)
        if msg.kind == "update_weight_version" and msg.args.get("abort_all_requests"):
            self._abort_all()
        if msg.kind == "pause_generation":
            return self._pause(msg)
        if msg.kind == "continue_generation":
            was = self.scheduler.paused
            self.scheduler.resume()
            if was is not None:
                log.info("generation continues (%d requests waiting)", len(self.scheduler.waiting))
            return ControlReply(msg.token, True, {"was_paused": was is not None, "paused": None})
        if msg.kind == "update_weight_version":
            self.scheduler.weight_version = msg.args["weight_version"]
            return ControlReply(msg.token, True, {"weight_version": self.scheduler.weight_version})
        if msg.kind == "get_weights_by_name":
            try:
                weights = self.scheduler.runner.get_weights_by_name(msg.args["name"], msg.args["truncate_size"])
            except ValueError as e:
                return ControlReply(msg.token, False, {"message": str(e)})
            return ControlReply(msg.token, True, {"weights": weights})
        if msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
            return self._lora(msg)
        if msg.kind == "flush_cache":
            return ControlReply(msg.token, self.scheduler.flush_cache())
        if msg.kind == "check_integrity":
            error = self._integrity_error()
            return ControlReply(msg.token, error is None, {"error": error, **self.kv_state()})
        return ControlReply(msg.token, False, {"error": f"unknown control request {msg.kind!r}"})

    def _start_job(self, msg: ControlReq) -> ControlReply | None:
        """Queue a weight update or group call (`WeightUpdates`), or the reply refusing it."""
        refusal = self.updates.check(msg)
        if refusal is not None:
            return ControlReply(msg.token, False, {"message": refusal})
        if msg.kind in WEIGHT_CHANGES and msg.args.get("abort_all_requests"):
            self._abort_all()
        if self.scheduler.paused == "in_place" and self.scheduler.holds_kv:
            return ControlReply(msg.token, False, {"message": IN_PLACE_UPDATE})
        self.updates.start(msg)
        return None

    def _pause(self, msg: ControlReq) -> ControlReply:
        """Pause generation (`Scheduler.pause`) in the mode `msg` names."""
        mode = msg.args["mode"]
        acted = self.scheduler.pause(mode)
        log.info("generation paused (%s): %d requests %s; new requests wait until /continue_generation", mode, acted,
                 {"abort": "aborted", "retract": "requeued", "in_place": "kept in place"}[mode])
        return ControlReply(msg.token, True, {"mode": mode, "requests": acted, "paused": mode})

    def _abort_all(self) -> None:
        log.info("aborting the %d requests in flight", len(self.live))
        for rid in sorted(self.live):
            self.scheduler.abort(rid)

    def kv_state(self) -> dict[str, Any]:
        s, kv = self.scheduler, self.scheduler.kv
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "live": len(self.live),
            "kv_size": kv.allocator.size,
            "kv_available": kv.allocator.available(),
            "kv_evictable": kv.cache.evictable_size(),
            "kv_protected": kv.cache.protected_size(),
            "rows_available": kv.table.available(),
            "rows": kv.table.size,
            "paused": self.scheduler.paused,
            "weight_update_pending": self.updates.active,
            "held_requests": self.updates.held_requests,
        }

    def _integrity_error(self) -> str | None:
        try:
            self.scheduler.check_integrity()
        except Exception as e:
            log.error("KV integrity check failed: %s", e)
            return f"{type(e).__name__}: {e}"
        return None

    # ------------------------------------------------------------------ stepping
    def run_step(self) -> None:
        """One scheduler step; its outputs go to the detokenizer, except those of requests
        that failed (a finish reason with a status code: a grammar that did not compile,
        a stop pattern that timed out), which go to HTTP as a `RequestError`, the one way a
        failure reaches it. On an exception every live request is aborted and answered
        with the error, then the loop goes on."""
        try:
            outputs = self.scheduler.step()
        except Exception as e:
            self._recover(e)
            return
        self.live.difference_update(o.rid for o in outputs if o.finish_reason is not None)
        failed = {o.rid: o.finish_reason for o in outputs if o.finish_reason and "status_code" in o.finish_reason}
        if failed:
            outputs = [o for o in outputs if o.rid not in failed]
        if outputs:
            self.send_detok(TokenBatch(outputs))
        if failed:
            self.send_detok(Forget(list(failed)))
            for rid, reason in failed.items():
                self.send_http(RequestError(rid, reason["message"], reason["status_code"]))
        self._stepped_since_check = True

    def idle_maintenance(self) -> None:
        """Once the scheduler is idle after stepping (at most once per
        `IDLE_CHECK_INTERVAL_S`): check the KV accounting and hand the heap's free memory
        (a large prefill's activations) back to the system, so an idle server's memory is
        what it holds, not what its last burst needed."""
        now = time.monotonic()
        if (self._stepped_since_check and not self.scheduler.has_work
                and now - self._last_idle_check >= IDLE_CHECK_INTERVAL_S):
            self._last_idle_check = now
            self._stepped_since_check = False
            error = self._integrity_error()
            self.stats.integrity = "ok" if error is None else error
            release_free_heap()

    def _recover(self, exc: Exception) -> None:
        rids = sorted(self.live)
        log.exception("scheduler step failed; aborting %d requests", len(rids), exc_info=exc)
        for rid in rids:
            self.scheduler.abort(rid)
        self.scheduler.step()  # retires the aborted requests; their clients get the error instead
        self.live.clear()
        self.send_detok(Forget(rids))
        message = "internal error in the scheduler (the server log has the details)"
        for rid in rids:
            self.send_http(RequestError(rid, message, 500))
        self.scheduler.check_integrity()  # if the KV state is broken, exit rather than serve

    def serve_forever(self, sock: zmq.Socket, parent: ParentWatch, ipc: IpcPaths) -> None:
        """Drain messages without blocking while there is work; block (briefly, to report
        stats, send heartbeats and notice an orphaned state) when idle."""
        heartbeat = HeartbeatClock()
        while True:
            if heartbeat.due():
                self.send_http(Heartbeat("scheduler"))
            busy = self.scheduler.has_work
            idle_wait = UPDATE_POLL_S if self.updates.active else self.stats.interval
            if sock.poll(0 if busy else int(idle_wait * 1000)):
                while True:
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self.handle(decode(data))
                    except Exception:  # a malformed message must not stop the loop
                        log.exception("dropping a message that could not be handled")
            elif not busy and not parent.alive():
                leave_orphaned(ipc)
                return
            if self.scheduler.has_work:
                self.run_step()
            for held in self.updates.advance():
                self.handle(held)
            if not self.updates.active:  # a load on the worker thread uses the heap
                self.idle_maintenance()
            report = self.stats.tick(self.scheduler, busy=self.scheduler.has_work)
            if report is not None:
                self.send_http(report)


def run_scheduler_process(engine: EngineConfig, stats_interval: float, log_interval: float,
                          log_level: str, ipc: IpcPaths, launcher: Connection, startup: Connection) -> None:
    """Process entry: load the model, warm it up, report ready, then serve forever (until
    SIGTERM, or the launcher is gone: `launcher` is `ParentWatch`'s link)."""
    setup_child(log_level)
    parent = ParentWatch(launcher)
    started = time.monotonic()
    try:
        from sprig.runtime.distributed.runner import make_runner
        from sprig.runtime.tokenizer import load_tokenizer

        log.info("loading the model from %s", engine.runner.model_path)
        tokenizer = load_tokenizer(engine.runner.model_path)
        runner = make_runner(engine.runner, engine.dist, on_failure=_exit_on_rank_failure,
                             draft_model_path=engine.scheduler.speculative_draft_model_path)
        if engine.dist.tp_size > 1:  # SIGTERM unwinds, so that `runner.close()` stops the other ranks
            signal.signal(signal.SIGTERM, _raise_system_exit)
        scheduler = Scheduler(engine.scheduler, runner, tokenizer)
        info = {
            "context_len": scheduler.context_len,
            "vocab_size": scheduler.vocab_size,
            "hidden_size": runner.model_config.hidden_size,
            "kv_size": scheduler.kv.allocator.size,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "attention_backend": runner.attention_backend,
            "tp_size": engine.dist.tp_size,
            "lora_adapters": scheduler.lora_adapters(),
            "image": image_info(runner),
            "no_images": runner.no_images,
        }
        loaded = time.monotonic()
        log.info("model loaded in %.1f s (%s on %s, a KV pool of %d tokens); warming up",
                 loaded - started, info["dtype"], info["device"], info["kv_size"])
        if runner.lora is not None:
            log.info("LoRA: %d adapter slots of rank %d on %s; loaded: %s", runner.lora.num_slots, runner.lora.rank,
                     ", ".join(sorted(runner.lora.kinds)), ", ".join(info["lora_adapters"]) or "none")
        moe = runner.model_config.moe
        if moe is not None:
            log.info("%s: a mixture of %d experts, %d per token", runner.model_config.architecture, moe.num_experts,
                     moe.top_k)
        config = runner.model_config
        if config.sliding_window is not None:
            log.info("%s: %d of %d layers attend within a sliding window of %d tokens (the KV pool keeps every "
                     "token)", config.architecture, len(config.sliding_layers), config.num_layers, config.sliding_window)
        warm_up(scheduler)
    except Exception as e:
        log.exception("the scheduler failed to start")
        report_startup(startup, StartupReport(False, error=f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    ctx = zmq.Context()
    sock = pull_socket(ctx, ipc.scheduler)
    to_detok, to_http = push_socket(ctx, ipc.detokenizer), push_socket(ctx, ipc.http)
    report_startup(startup, StartupReport(True, info=info))
    log.info("scheduler ready (warm-up %.1f s): %s", time.monotonic() - loaded, info)
    loop = SchedulerLoop(
        scheduler,
        send_detok=lambda m: to_detok.send(encode(m)),
        send_http=lambda m: to_http.send(encode(m)),
        stats=StatsTracker(stats_interval, log_interval),
    )
    try:
        loop.serve_forever(sock, parent, ipc)
    finally:
        loop.updates.close()
        scheduler.close()
        runner.weight_groups.close()  # rank 0's (the other ranks close theirs as they stop)
        runner.close()


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _exit_on_rank_failure(message: str) -> None:
    """A tensor-parallel rank is gone (the runner has logged which): the model cannot run,
    so this process exits and the server, which watches it, turns unhealthy and exits."""
    logging.shutdown()
    os._exit(1)


def warm_up(scheduler: Scheduler) -> None:
    """Run one short request through every stage so the first client does not pay for
    lazy initialization; leaves the cache empty."""
    params = SamplingParams(max_new_tokens=2, temperature=0.0)  # greedy: the RNG is untouched
    scheduler.add_request(Req(rid="warmup", prompt_ids=[0, 1, 2, 3], params=params))
    while scheduler.has_work:
        scheduler.step()
    scheduler.flush_cache()
    scheduler.kv.cache.reset_counters()
    scheduler.stats = SchedulerStats()


def image_info(runner: Any) -> dict[str, Any] | None:
    """How the served model takes images (`ImageSpec` without its vision config), for the
    HTTP process's `ImagePrompter`; None when it takes none."""
    spec = runner.model_config.image
    if spec is None or not runner.takes_images:
        return None
    return {"token_id": spec.token_id, "begin_id": spec.begin_id, "end_id": spec.end_id,
            "tokens_per_image": spec.tokens_per_image, "bidirectional": spec.bidirectional}
