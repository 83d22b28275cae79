"""Every Triton kernel compiles for an NVIDIA GPU (sm_90, bfloat16 activations) on this
machine, which has none (`nvidia_compile.py`: the interpreter, which the other kernel
tests run, accepts code the compiler refuses). The whole matrix, every activation dtype
for sm_80 and sm_90: `python tests/kernels/nvidia_compile.py 80 90`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("nvidia_compile.py")


def test_every_kernel_compiles_for_sm90() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--dtypes", "bfloat16", "90"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:] or run.stdout[-4000:]
    kernels = run.stdout.rsplit("kernels: ", 1)[1].split(", ")
    assert len(kernels) == 10 and "_expert_matmul_kernel" in kernels and "sm_90: compiled" in run.stdout
