"""Wall-clock timing of a device pass, for the pass costs (`cost.PassCosts`) that are
measured rather than given: a pass counts until the device has computed its result."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed_ms(run: Callable[[], object], repeats: int = 7) -> float:
    """Median wall milliseconds of `run()` over `repeats` calls, after one untimed call.
    A call that returns a CUDA tensor is timed until the device has computed it: a pass
    of the scheduler ends by reading its tokens back, so kernel launches alone (a CUDA
    graph's replay is one) would make it look far cheaper than it is."""
    finished(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        finished(run())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def finished(result: object) -> None:
    """Wait for the device that computes `result`, where it is a CUDA tensor."""
    if isinstance(result, torch.Tensor) and result.is_cuda:
        torch.cuda.synchronize(result.device)
