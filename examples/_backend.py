"""The server every example runs on: the one at --url, or a local `Runtime` on the
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


def sampling_parser(description: str, n: int | None = 8) -> argparse.ArgumentParser:
    """`parser` plus `--seed` (and `-n`, the samples to draw) for the sampling examples."""
    p = parser(description)
    if n is not None:
        p.add_argument("-n", type=int, default=n, help=f"samples to draw (default: {n})")
    p.add_argument("--seed", type=int, default=0, help="the first sampling seed (each sample has its own, "
                   "counted from it): the same output every run (default: 0)")
    return p


@contextlib.contextmanager
def server_url(args: argparse.Namespace) -> Iterator[str]:
    """The server's base URL; a local server is shut down after the block."""
    if args.url:
        yield args.url.rstrip("/")
        return
    print("starting a local sprig server ...", flush=True)
    with sprig.Runtime(args.model) as runtime:
        yield runtime.url


@contextlib.contextmanager
def backend(args: argparse.Namespace) -> Iterator[sprig.Backend]:
    """Set and yield the default backend (a `RuntimeEndpoint` to the server)."""
    with server_url(args) as url:
        endpoint = sprig.RuntimeEndpoint(url)
        sprig.set_default_backend(endpoint)
        try:
            yield endpoint
        finally:
            endpoint.close()
