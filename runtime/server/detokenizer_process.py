"""The detokenizer process: token ids in, text deltas out, one `OutputDecoder` per request
(a request with stop strings brings its text from the scheduler, which decoded it while
checking them, and only its logprob entries are decoded here).

Invariant: a request's decoder exists from its `DetokRegister` until the output that
finishes it (or a `Forget`); outputs for unknown rids are dropped. A failure decoding one
request answers that request with a `RequestError` and leaves the others untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.connection import Connection

import zmq

from sprig.runtime.detokenizer import DetokenizeConfig
from sprig.runtime.response import OutputDecoder
from sprig.runtime.server.child import (
    HeartbeatClock,
    ParentWatch,
    leave_orphaned,
    report_startup,
    setup_child,
)
from sprig.runtime.server.ipc import IpcPaths, pull_socket, push_socket
from sprig.runtime.wire import (
    DetokenizedBatch,
    DetokenizedOutput,
    DetokRegister,
    Forget,
    Heartbeat,
    RequestError,
    StartupReport,
    TokenBatch,
    decode,
    encode,
)

log = logging.getLogger("sprig.detokenizer")
POLL_MS = 1000


class DetokenizerLoop:
    def __init__(self, tokenizer, send_http: Callable[[object], None]) -> None:
        self.tokenizer = tokenizer
        self.send_http = send_http
        self.decoders: dict[str, OutputDecoder] = {}

    def handle(self, msg: object) -> None:
        if isinstance(msg, DetokRegister):
            config = DetokenizeConfig(  # no stops: a request with stops arrives with its text
                skip_special_tokens=msg.skip_special_tokens,
                spaces_between_special_tokens=msg.spaces_between_special_tokens,
            )
            self.decoders[msg.rid] = OutputDecoder(
                self.tokenizer,
                msg.prompt_tail,
                config,
                logprob_text=msg.logprob_text,
                incremental=msg.incremental,
            )
        elif isinstance(msg, TokenBatch):
            outputs = [d for d in map(self._decode, msg.outputs) if d is not None]
            if outputs:
                self.send_http(DetokenizedBatch(outputs))
        elif isinstance(msg, Forget):
            for rid in msg.rids:
                self.decoders.pop(rid, None)
        else:
            log.error("ignoring unexpected message %s", type(msg).__name__)

    def _decode(self, out) -> DetokenizedOutput | None:
        decoder = self.decoders.get(out.rid)
        if decoder is None:
            return None
        if out.finish_reason is not None:
            del self.decoders[out.rid]
        try:
            return decoder.decode(out)
        except Exception:
            log.exception("detokenizing request %s failed", out.rid)
            self.decoders.pop(out.rid, None)
            self.send_http(RequestError(out.rid, "internal error in the detokenizer (see the server log)", 500))
            return None


def run_detokenizer_process(model_path: str, log_level: str, ipc: IpcPaths, launcher: Connection,
                            startup: Connection) -> None:
    """Process entry: load the tokenizer, report ready, then translate forever."""
    setup_child(log_level)
    parent = ParentWatch(launcher)
    try:
        from sprig.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path)
    except Exception as e:
        log.exception("the detokenizer failed to start")
        report_startup(startup, StartupReport(False, error=f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    ctx = zmq.Context()
    sock = pull_socket(ctx, ipc.detokenizer)
    to_http = push_socket(ctx, ipc.http)
    report_startup(startup, StartupReport(True))
    loop = DetokenizerLoop(tokenizer, lambda m: to_http.send(encode(m)))
    heartbeat = HeartbeatClock()
    while True:
        if heartbeat.due():
            to_http.send(encode(Heartbeat("detokenizer")))
        if not sock.poll(POLL_MS):
            if not parent.alive():
                leave_orphaned(ipc)
                return
            continue
        try:
            loop.handle(decode(sock.recv()))
        except Exception:  # a malformed message must not stop the loop
            log.exception("dropping a message that could not be handled")
