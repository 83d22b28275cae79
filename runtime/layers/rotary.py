"""Rotary position embedding: one cos/sin table per model, shared by its layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sprig.kernels.rotary import apply_rotary, rope_cos_sin


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token positions (HF `rotate_half` convention).

    The float32 tables cover positions `0 .. max_positions-1`; they are derived from
    the config, not read from the checkpoint, so `reset_buffers()` recomputes them after
    the module is materialised on its device.
    """

    def __init__(
        self, head_dim: int, max_positions: int, *, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables in float32 on the buffers' current device."""
        if self.cos.is_meta:
            return
        self.cos, self.sin = rope_cos_sin(  # [P, D] each
            self.head_dim, self.max_positions, base=self.base, scaling=self.scaling,
            device=self.cos.device, dtype=torch.float32,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64, each < max_positions
        x: torch.Tensor,  # [T, H, D]: q's heads, k's, or both side by side
    ) -> torch.Tensor:  # [T, H, D], a new tensor
        return apply_rotary(x, positions, self.cos, self.sin)
