"""RMSNorm as a module over `sprig.kernels.rmsnorm` (fused residual add included)."""

from __future__ import annotations

import torch
from torch import nn

from sprig.kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """Hugging Face `LlamaRMSNorm` semantics over the last dim of size `size`; with
    `round_once`, OLMo's (scaled in float32, rounded once); with `unit_offset`, Gemma's
    (scaled by 1 + weight); see `sprig.kernels.rmsnorm`."""

    def __init__(self, size: int, eps: float, *, unit_offset: bool = False, round_once: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.round_once = round_once
        self.weight = nn.Parameter(torch.empty(size))  # [size]

    def forward(
        self,
        x: torch.Tensor,  # [..., size]
        residual: torch.Tensor | None = None,  # [..., size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns norm(x), or (norm(x + residual), x + residual) when given a residual."""
        return rms_norm(x, self.weight, self.eps, residual, unit_offset=self.unit_offset, round_once=self.round_once)
