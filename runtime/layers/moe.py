"""The sparse feed-forward blocks of mixture-of-experts models: Mixtral's, Qwen2-MoE's and
Qwen3-MoE's (a router, E SwiGLU experts with stacked weights, and optionally a shared
expert every token runs through), and gpt-oss's (a biased router, E biased experts with
a clamped SwiGLU, float or MXFP4); see `sprig.runtime.model_config.MoEConfig`."""

from __future__ import annotations

import torch
from torch import nn

from sprig.kernels.moe import ClampedSwiGLU, fused_experts, route_topk
from sprig.kernels.mxfp4 import Mxfp4Weight
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


class GptOssExperts(nn.Module):
    """gpt-oss's E experts, in the checkpoint's own tensors: `gate_up_proj [E, H, 2I]` (each
    expert's gate and up columns interleaved) and `down_proj [E, I, H]`, or in MXFP4 their
    `*_blocks` and `*_scales` (stored as [E, 2I, H] and [E, H, I], kept packed); and the
    biases `gate_up_proj_bias [E, 2I]` and `down_proj_bias [E, H]`.

    Float weights are held as `[E, 2I, H]` and `[E, H, I]` (the kernel's layout); a
    checkpoint's tensor loads into their transposed view (`checkpoint_view`)."""

    MXFP4_GROUP = 32  # inputs per scale

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        assert moe.clamped_swiglu is not None
        E, H, inter = moe.num_experts, hidden_size, moe.expert_intermediate_size
        self.activation = ClampedSwiGLU(*moe.clamped_swiglu)
        self.mxfp4 = moe.expert_format == "mxfp4"
        if self.mxfp4:
            g = self.MXFP4_GROUP
            self.gate_up_proj_blocks = _codes(E, 2 * inter, H // g, g // 2)
            self.gate_up_proj_scales = _codes(E, 2 * inter, H // g)
            self.down_proj_blocks = _codes(E, H, inter // g, g // 2)
            self.down_proj_scales = _codes(E, H, inter // g)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
            self.down_proj = nn.Parameter(torch.empty(E, H, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))

    def checkpoint_view(self, leaf: str, param: torch.Tensor) -> torch.Tensor:
        """Where the checkpoint's tensor `leaf` goes in `param`: float projections are
        stored transposed."""
        return param.transpose(1, 2) if leaf in ("gate_up_proj", "down_proj") else param

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, K] float32
        ids: torch.Tensor,  # [T, K]
        *,
        down_bias: bool = True,  # False: leave `down_proj_bias` out (another rank adds it)
    ) -> torch.Tensor:  # [T, H]
        if self.mxfp4:
            w13 = Mxfp4Weight(self.gate_up_proj_blocks, self.gate_up_proj_scales)
            w2 = Mxfp4Weight(self.down_proj_blocks, self.down_proj_scales)
        else:
            w13, w2 = self.gate_up_proj, self.down_proj
        return fused_experts(x, w13, w2, weights, ids, b13=self.gate_up_proj_bias,
                             b2=self.down_proj_bias if down_bias else None, activation=self.activation)


def _codes(*shape: int) -> nn.Parameter:
    """A packed uint8 tensor that loads like a weight and never takes the model's dtype."""
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)


class GptOssMoE(nn.Module):
    """gpt-oss's sparse block: the biased `router` picks each token's top-k experts, weighted
    by the softmax of their logits (`route_topk` renormalized: the same distribution)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.router = nn.Linear(hidden_size, moe.num_experts, bias=True)
        self.experts = GptOssExperts(hidden_size, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = route_topk(self.router(x), self.top_k, renormalize=True)  # [T, K] each
        return self.experts(x, weights, ids)
