"""The CLI's parser and help import neither torch nor transformers: every config it reads
and every name its choices come from live in torch-free modules. Those names stand for
registries and torch objects kept elsewhere; each list is checked here against what it
stands for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sprig.radix.eviction import EVICTION_POLICIES as EVICTION_REGISTRY
from sprig.radix.kv_cache import KV_CACHE_DTYPES as KV_STORAGE
from sprig.runtime.quantization.formats.online import SCHEMES
from sprig.runtime.quantization.online_schemes import ONLINE_SCHEMES
from sprig.runtime.runner_config import DEVICE, DTYPES, KV_CACHE_DTYPES
from sprig.runtime.scheduler.config import EVICTION_POLICIES

HEAVY = ("torch", "transformers")
HELP_SCRIPT = """
import contextlib, io, sys
from sprig.runtime.cli import main
for argv in ([], ["--help"], ["serve", "--help"], ["router", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert "usage: sprig" in out.getvalue(), argv
print(" ".join(m for m in {heavy!r} if m in sys.modules))
"""


def test_help_imports_neither_torch_nor_transformers() -> None:
    """Each command's help, rendered in a fresh interpreter, leaves both unimported."""
    run = subprocess.run([sys.executable, "-c", HELP_SCRIPT.format(heavy=HEAVY)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == []


def test_the_config_names_are_the_registries_keys() -> None:
    assert set(EVICTION_POLICIES) == set(EVICTION_REGISTRY)
    assert set(KV_CACHE_DTYPES) == set(KV_STORAGE)
    assert set(ONLINE_SCHEMES) == set(SCHEMES)


def test_every_dtype_name_is_a_torch_dtype() -> None:
    assert all(isinstance(getattr(torch, name, None), torch.dtype) for name in DTYPES)


@pytest.mark.parametrize("device", [
    "cpu", "cuda", "cpu:0", "cuda:0", "cuda:12",
    "", "CUDA", "cuda:", "cuda:01", "cuda:-1", "cuda:+1", "cuda: 0", " cuda", "cuda:1:2", "cuda:١", "mps", "meta", "tpu",
])
def test_the_device_pattern_accepts_what_torch_reads_as_cpu_or_cuda(device: str) -> None:
    try:
        torch_accepts = torch.device(device).type in ("cpu", "cuda")
    except RuntimeError:
        torch_accepts = False
    assert bool(DEVICE.fullmatch(device)) == torch_accepts
