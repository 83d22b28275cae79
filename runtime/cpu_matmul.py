"""How fast this CPU multiplies half-precision matrices, against float32.

torch multiplies bfloat16 fast on CPUs with AVX512 (and newer); on AVX2-only CPUs it has
no vectorised bfloat16 path, and a bfloat16 matmul takes tens of times as long as a float32
one (11-33x measured on an AMD EPYC at the demo model's training shapes). Callers measure
this rather than guess it from CPU flags: training picks its autocast by it
(`scripts/train_demo_model.py`), and the model runner says in its log when a checkpoint's
half dtype will run slowly.
"""

from __future__ import annotations

import time

import torch


def matmul_slowdown(dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """How many times longer an [m, k] by [k, n] matmul in `dtype` takes than in float32 on
    this CPU with torch's current threads: the best of three timed runs each, after one
    that warms up. About 1 or less where the CPU has a fast path for `dtype`."""
    x, w = torch.randn(m, k), torch.randn(k, n)

    def best(dt: torch.dtype) -> float:
        a, b = x.to(dt), w.to(dt)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best(dtype) / best(torch.float32)
