"""The server's children fork from a forkserver that imported their modules once.

A "spawn" child starts a fresh interpreter and imports torch, transformers and the
runtime itself (about 6 s on 2 CPU cores) before it can load the model. The scheduler
and the detokenizer are instead started from multiprocessing's "forkserver": a
single-threaded process that imports `CHILD_MODULES` once and forks each child from
that state, with no thread, CUDA context or lock of this process in it (what makes
"fork" unsafe with torch). Started before this process parses its flags
(`start_forkserver`), it imports while they are parsed.

Its children end with `os._exit` (multiprocessing's), and so do the forkserver
(`forkserver_exit`) and the server's process (`processes.exit_now`): the interpreter's
teardown would spend seconds freeing torch's C++ registries after everything has stopped.

`transformers.activations` is among them because loading any model's config imports it
(and through it `torch.distributed.tensor` and sympy): about 2.5 s of each child's
startup on 2 cores, which transformers would otherwise import lazily in both children.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

CHILD_MODULES = (
    "sprig.runtime.server.scheduler_process",
    "sprig.runtime.server.detokenizer_process",
    "sprig.runtime.tokenizer",
    "transformers.activations",
    "sprig.runtime.server.forkserver_exit",  # last: the forkserver's own exit skips the teardown
)


def start_forkserver() -> BaseContext:
    """Start the forkserver (importing `CHILD_MODULES`) unless it runs already; returns
    the context to start children with. Returns at once: the imports run in the
    forkserver while this process goes on."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(CHILD_MODULES))
    forkserver.ensure_running()
    return ctx
