"""Starting and stopping the three processes of one server.

This process imports what it serves with while the forkserver imports the children's
modules (`server.forkserver`), binds the HTTP port (fail fast), creates the private ipc
directory, starts the scheduler and the detokenizer from the forkserver, loads its own
tokenizer on a thread while they load, waits for both to report ready (a child that fails
ends the wait at once), then serves HTTP in the main thread. However it stops (SIGINT,
SIGTERM, a startup error, a child that died or is stuck: then `RuntimeError`, and the CLI
exits 1), the children are terminated and joined and the ipc directory is removed before
`launch_server` returns; if this process is killed outright, the children remove the
directory as they exit.

Only the children's arguments (config dataclasses, the ipc paths, a pipe end) go through
multiprocessing's own pickling, over the forkserver's pipe; everything else is msgpack.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import uvicorn

from sprig.runtime.engine_config import EngineConfig
from sprig.runtime.model_config import ImageSpec
from sprig.runtime.multimodal.media import MediaLimits
from sprig.runtime.multimodal.prompts import load_prompter
from sprig.runtime.server.app import create_app
from sprig.runtime.server.child import setup_logging
from sprig.runtime.server.config import ServerConfig, default_model_name
from sprig.runtime.server.detokenizer_process import run_detokenizer_process
from sprig.runtime.server.forkserver import start_forkserver
from sprig.runtime.server.harmony_call import HarmonyServing
from sprig.runtime.server.http_io import ServerState
from sprig.runtime.server.http_protocol import with_header_timeout
from sprig.runtime.server.ipc import IpcPaths
from sprig.runtime.server.metrics import Metrics
from sprig.runtime.server.request_builder import RequestBuilder
from sprig.runtime.server.request_manager import RequestManager, ServedWeights
from sprig.runtime.server.responses_store import ResponseStore
from sprig.runtime.server.scheduler_process import run_scheduler_process
from sprig.runtime.server.stop_signals import exit_on_stop_signals, ignore_stop_signals
from sprig.runtime.server.tool_formats import resolve_format
from sprig.runtime.tokenizer import load_tokenizer
from sprig.runtime.wire import StartupReport, decode

log = logging.getLogger("sprig.launch")
CHILD_STOP_TIMEOUT_S = 5.0


def launch_server(model_path: str, server: ServerConfig, engine: EngineConfig) -> None:
    """Serve until SIGINT or SIGTERM. Raises `RuntimeError` if the server cannot start, or
    stopped because a child process died or got stuck."""
    setup_logging(server.log_level)
    exit_on_stop_signals()
    sock = _listen(server.host, server.port)
    log.info("bound %s; starting the scheduler (which loads %s) and the detokenizer", _address(sock), model_path)
    ipc = IpcPaths.create()
    children: dict[str, BaseProcess] = {}
    link = None
    try:
        startup, link = _spawn_children(model_path, server, engine, ipc, children)
        loading = ThreadPoolExecutor(1, thread_name_prefix="sprig-tokenizer")
        tokenizer = loading.submit(load_tokenizer, model_path)
        loading.shutdown(wait=False)
        info = _await_startup(startup, children)["scheduler"].info
        _serve(sock, model_path, server, engine, ipc, children, tokenizer.result(), info)
    finally:
        ignore_stop_signals()
        _stop_children(children)
        if link is not None:
            link.close()
        ipc.remove()
        sock.close()
        log.info("server stopped")


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from None
    sock.listen(2048)
    return sock


def _address(sock: socket.socket) -> str:
    """host:port of a bound socket (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def _spawn_children(model_path: str, server: ServerConfig, engine: EngineConfig, ipc: IpcPaths,
                    children: dict[str, BaseProcess]) -> tuple[dict[str, Connection], Connection]:
    """Start both children (recorded in `children` as soon as each starts); returns the
    pipe each reports its startup on, and the write end of the children's `ParentWatch`
    link, which this process must hold open (and never write to) while they run."""
    ctx = start_forkserver()
    link_reader, link_writer = ctx.Pipe(duplex=False)
    targets = {
        "scheduler": (run_scheduler_process, (engine, server.stats_interval, server.log_interval, server.log_level, ipc)),
        "detokenizer": (run_detokenizer_process, (model_path, server.log_level, ipc)),
    }
    startup = {}
    for name, (target, args) in targets.items():
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, link_reader, writer), name=f"sprig-{name}", daemon=True)
        proc.start()
        writer.close()  # the child holds the only writer: EOF here means it died
        children[name], startup[name] = proc, reader
    link_reader.close()
    return startup, link_writer


def _await_startup(startup: dict[str, Connection], children: dict[str, BaseProcess]) -> dict[str, StartupReport]:
    reports: dict[str, StartupReport] = {}
    pending = dict(startup)
    while pending:
        for conn in wait(list(pending.values())):
            name = next(n for n, c in pending.items() if c is conn)
            del pending[name]
            try:
                report = decode(conn.recv_bytes())
            except EOFError:
                children[name].join(CHILD_STOP_TIMEOUT_S)
                raise RuntimeError(
                    f"the {name} process exited during startup (exit code {children[name].exitcode})"
                ) from None
            finally:
                conn.close()
            if not report.ok:
                raise RuntimeError(f"the {name} process failed to start: {report.error}")
            reports[name] = report
    return reports


def _serve(sock: socket.socket, model_path: str, server: ServerConfig, engine: EngineConfig, ipc: IpcPaths,
           children: dict[str, BaseProcess], tokenizer, info: dict) -> None:
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        http.should_exit = True

    builder = RequestBuilder(tokenizer, info["context_len"], info["vocab_size"], server.chat_template,
                             priority_scheduling=engine.scheduler.enable_priority_scheduling,
                             **image_prompter(model_path, info, tokenizer, server))
    template = builder.chat.source if builder.chat else None
    harmony = HarmonyServing.of(server.reasoning_parser, server.tool_call_parser, template)
    tool_format = None if harmony is not None else resolve_format(server.tool_call_parser, template, tokenizer.get_vocab())
    calls = "harmony" if harmony is not None and harmony.calls else tool_format.name if tool_format else None
    log.info("tool calls in chat answers: %s", calls or "not parsed")
    state = ServerState(
        config=server,
        engine=engine,
        model_path=model_path,
        model_name=server.served_model_name or default_model_name(model_path),
        model_info=info,
        manager=RequestManager(
            ipc, children, Metrics(), engine.scheduler.max_queued_requests, server.watchdog_timeout, on_fatal,
            weights=ServedWeights(model_path, engine.scheduler.weight_version, dict(info["lora_adapters"])),
        ),
        builder=builder,
        tool_format=tool_format,
        harmony=harmony,
        context_free=getattr(tokenizer, "backend_tokenizer", None) is not None and tokenizer.eos_token_id is not None,
        started=time.monotonic(),
        url=f"http://{_address(sock)}",
        pool=ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="sprig-requests"),
        responses=ResponseStore(server.responses_store_bytes),
    )
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(
        create_app(state), loop=loop, log_config=None, log_level=server.log_level,
        access_log=server.access_log, timeout_graceful_shutdown=5, http=with_header_timeout(server.read_timeout),
    )
    http = uvicorn.Server(config)
    try:
        http.run(sockets=[sock])
    finally:
        state.pool.shutdown(wait=False, cancel_futures=True)
    if fatal:
        raise RuntimeError(fatal[0])


def _stop_children(children: dict[str, BaseProcess]) -> None:
    for proc in children.values():
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for name, proc in children.items():
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            log.warning("the %s process did not stop on SIGTERM; killing it", name)
            proc.kill()
            proc.join(1.0)


def image_prompter(model_path: str, info: dict[str, Any], tokenizer: Any, server: ServerConfig) -> dict[str, Any]:
    """`RequestBuilder`'s `images` (how prompts take images, within the server's media
    limits) and `no_images` (why requests with images are refused, when they are), from
    the scheduler's report (`info["image"]`: the model's image spec, or None)."""
    image = info.get("image")
    local = server.allowed_local_media_path
    limits = MediaLimits(allowed_local_dir=None if local is None else Path(local), allow_http=not server.disable_media_urls)
    prompter, why = load_prompter(model_path, None if image is None else ImageSpec(**image, vision={}), tokenizer,
                                  limits, info["no_images"])
    if prompter is not None:
        log.info("images: %d tokens each; local files %s; http(s) URLs %s", image["tokens_per_image"],
                 f"under {local}" if local else "refused", "refused" if server.disable_media_urls else "fetched")
    return {"images": prompter, "no_images": why}
