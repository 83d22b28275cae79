"""Rotary position embedding: one cos/sin table per model, shared by its layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sprig.kernels._dispatch import use_triton
from sprig.kernels.rotary import apply_rotary_ref, apply_rotary_triton, rope_cos_sin, rotary_rows
from sprig.runtime.model_config import ModelConfig


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads by their token positions (HF `rotate_half` convention):
    the first `rotary_dim` dims of each head (all of them unless the model's rotary is
    partial, `ModelConfig.rotary_dim`); the others pass through.

    The float32 tables `[max_positions, rotary_dim]` cover positions `0 .. max_positions-1`
    (a longrope model's factors are chosen by `max_positions`, `rope_cos_sin`); they are derived from
    the config, not read from the checkpoint, so `reset_buffers()` recomputes them after
    the module is materialised on its device. On the torch path the table rows of the
    last `positions` tensor are kept: the layers of a step gather them once.
    """

    def __init__(
        self, rotary_dim: int, max_positions: int, *, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.register_buffer("cos", torch.empty(max_positions, rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, rotary_dim), persistent=False)
        self.reset_buffers()

    _rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # positions, their rows

    def reset_buffers(self) -> None:
        """(Re)compute the tables in float32 on the buffers' current device."""
        self._rows = None
        if self.cos.is_meta:
            return
        self.cos, self.sin = rope_cos_sin(  # [P, R] each
            self.rotary_dim, self.max_positions, base=self.base, scaling=self.scaling,
            device=self.cos.device, dtype=torch.float32,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64, each < max_positions
        x: torch.Tensor,  # [T, H, D]: q's heads, k's, or both side by side
    ) -> torch.Tensor:  # [T, H, D], a new tensor
        if use_triton(x, positions, self.cos, self.sin):
            return apply_rotary_triton(x, positions, self.cos, self.sin)
        kept = self._rows
        if kept is None or kept[0] is not positions or kept[1].dtype != x.dtype:
            kept = self._rows = (positions, *rotary_rows(positions, self.cos, self.sin, x.dtype))
        return apply_rotary_ref(x, positions, self.cos, self.sin, rows=kept[1:])


class LayerRotaries(nn.Module):
    """The RoPE of each layer of a family whose sliding-window layers have one of their own
    (`ModelConfig.sliding_rope_theta`: Gemma 3, OLMo 3): `local`, unscaled, in the sliding
    layers; `full`, with the config's scaling, in the others."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.full = RotaryEmbedding(config.rotary_dim, config.context_len, base=config.rope_theta,
                                    scaling=config.rope_scaling)
        self.local = RotaryEmbedding(config.rotary_dim, config.context_len,
                                     base=config.sliding_rope_theta or config.rope_theta, scaling=None)
        self.sliding = frozenset(config.sliding_layers)

    def of(self, layer_id: int) -> RotaryEmbedding:
        return self.local if layer_id in self.sliding else self.full
