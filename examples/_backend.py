"""The backend every example runs on: a server at --url, or a local `Runtime` on the
default model (sprig's embedded demo model) or on --model."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import sprig


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running sprig or SGLang server (default: start one locally)")
    p.add_argument("--model", help="local checkpoint for the local server (default: the demo model)")
    return p


@contextlib.contextmanager
def backend(args: argparse.Namespace) -> Iterator[sprig.Backend]:
    """Set and yield the default backend; a local server is shut down afterwards."""
    if args.url:
        endpoint = sprig.RuntimeEndpoint(args.url)
        sprig.set_default_backend(endpoint)
        yield endpoint
        return
    print("starting a local sprig server ...", flush=True)
    with sprig.Runtime(args.model) as runtime:
        sprig.set_default_backend(runtime.endpoint)
        yield runtime.endpoint
