"""SIGINT and SIGTERM in the process that launches and supervises others: while it runs,
either signal raises `SystemExit(0)` in its main thread, so its `finally` blocks stop
what it started; while it stops them, both are ignored (Ctrl+C reaches the whole process
group, and a second one must not cut the shutdown short)."""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("sprig.launch")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_on_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit)


def ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _exit(signum: int, frame: object) -> None:
    log.info("received %s; shutting down", signal.Signals(signum).name)
    raise SystemExit(0)
