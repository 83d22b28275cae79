"""The sparse feed-forward block of mixture-of-experts models (Mixtral, Qwen2-MoE,
Qwen3-MoE): a router, E SwiGLU experts with stacked weights, and optionally a shared
expert every token runs through (`sprig.runtime.model_config.MoEConfig`)."""

from __future__ import annotations

import torch
from torch import nn

from sprig.kernels.moe import fused_experts, route_topk
from sprig.runtime.layers.mlp import GatedMLP
from sprig.runtime.model_config import MoEConfig

EXPERT_SHARDS = ("gate", "up", "down")


class FusedExperts(nn.Module):
    """E experts' weights stacked: `gate_up_proj [E, 2I, H]` (each expert's gate rows,
    then its up rows) and `down_proj [E, H, I]`.

    A checkpoint stores each expert's projections apart (`experts.{e}.gate_proj.weight`
    and so on); the weight loader maps them to the shards `"{e}.gate"`, `"{e}.up"` and
    `"{e}.down"` (`checkpoint_shards`), and `shard_rows` is where each one goes."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def checkpoint_shards(self, leaf: str) -> list[str]:
        """The shards that make up parameter `leaf`."""
        kinds = ("gate", "up") if leaf == "gate_up_proj" else ("down",)
        return [f"{e}.{kind}" for e in range(self.num_experts) for kind in kinds]

    def shard_rows(self, shard: str) -> tuple[int, slice] | tuple[int]:
        """Where shard `"{e}.{kind}"` sits in its parameter."""
        expert, kind = shard.split(".")
        e, inter = int(expert), self.intermediate_size
        if kind == "gate":
            return (e, slice(0, inter))
        if kind == "up":
            return (e, slice(inter, 2 * inter))
        return (e,)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, K] float32
        ids: torch.Tensor,  # [T, K]
    ) -> torch.Tensor:  # [T, H]
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)


class SparseMoE(nn.Module):
    """`experts(x) (+ sigmoid(shared_expert_gate(x)) * shared_expert(x))`, the experts
    picked and weighted per token by the router `gate` (`route_topk`).

    Module names mirror the checkpoint's: `gate`, `experts`, `shared_expert`,
    `shared_expert_gate`."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.expert_intermediate_size)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, moe.shared_expert_intermediate_size, bias=False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize)  # [T, K] each
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
