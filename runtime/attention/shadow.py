"""Shadow mode: every layer of every step runs through the chosen backend and through
the plain reference backend, and the two outputs must agree.

The chosen backend's output is what the model goes on with; the reference's is computed
from the same q/k/v and the same pool, so a backend that attends to the wrong slots, reads
stale kept K/V or hands a request another's rows fails at the first layer where it does.
"""

from __future__ import annotations

import torch

from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch

# (atol, rtol) by the dtype attention reads (a quantized pool's too: every path reads the
# same dequantized values): float32 paths differ only by summation order; in 16-bit the
# outputs are rounded to the dtype, so they may differ by one unit in the last place.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


class ShadowMismatch(AssertionError):
    """The chosen backend's attention differs from the reference's."""


class ShadowAttention:
    """Wraps `backend`: returns its output after checking it against `reference`'s.

    Raises `ShadowMismatch` naming the step, mode, layer and batch rows that differ.
    """

    supports_cuda_graph = False  # the reference and the comparison run on the host's schedule

    def __init__(self, backend: AttentionBackend, reference: AttentionBackend) -> None:
        self.backend = backend
        self.reference = reference
        self.steps = 0  # steps begun
        self.checked = 0  # layer outputs compared

    def begin_step(self, batch: ForwardBatch) -> None:
        self.backend.begin_step(batch)
        self.reference.begin_step(batch)
        self.steps += 1

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer: int,
        batch: ForwardBatch,
        *,
        sm_scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [Hq] float32
    ) -> torch.Tensor:  # [T, Hq, D]
        options = {"sm_scale": sm_scale, "window": window, "softcap": softcap, "sinks": sinks}
        got = self.backend.forward(q, k, v, layer, batch, **options)
        want = self.reference.forward(q, k, v, layer, batch, **options)
        atol, rtol = TOLERANCES[batch.kv_cache.shape.dtype]
        excess = (got.float() - want.float()).abs() - (atol + rtol * want.float().abs())  # [T, Hq, D]
        bad = excess.amax(dim=(1, 2)) > 0  # [T]
        if bool(bad.any()):
            tokens = torch.nonzero(bad).flatten().tolist()
            token_req = torch.searchsorted(batch.qo_indptr.to("cpu", torch.int64), torch.tensor(tokens), right=True) - 1
            raise ShadowMismatch(
                f"step {self.steps} ({batch.mode.value}), layer {layer}: the attention of requests "
                f"{sorted(set(token_req.tolist()))[:8]} (of {batch.batch_size}) differs from the reference "
                f"by up to {float((got.float() - want.float()).abs().max()):.3g} (atol {atol}, rtol {rtol})"
            )
        self.checked += 1
        return got
