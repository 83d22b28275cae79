"""The gated feed-forward block: down(act(gate(x)) * up(x)), act SiLU (SwiGLU: the Llama
family) or tanh-approximated GELU (GeGLU: Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from sprig.kernels.activation import act_and_mul
from sprig.runtime.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, gelu: bool = False) -> None:
        super().__init__()
        self.gelu = gelu
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(act_and_mul(self.gate_up_proj(x), gelu=self.gelu))  # via [T, 2I], [T, I]
