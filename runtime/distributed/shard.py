"""Splitting a model over the ranks of a tensor-parallel group.

Rank r of n holds: q heads `r * Hq/n ..`; its KV heads (`Hkv/n` of them, or, with fewer KV
heads than ranks, the one KV head its q heads read, replicated on `n/Hkv` ranks); the
intermediate features `r * I/n ..` of the MLP; a contiguous slice of the vocabulary (sizes
differ by at most one). q/k/v and gate/up are column-parallel, o and down row-parallel
(one all-reduce each), the embedding and the LM head vocab-parallel; OLMo's q and k norms
(each over a whole projection) hold their heads' slice of the weight and sum the squares
over the ranks (one all-reduce each). In a mixture-of-experts
model every rank holds every expert's intermediate features `r * I/n ..` (and the shared
expert's, split as an MLP); the router and the shared expert's gate are replicated (gpt-oss:
`GptOssExpertSlices`; its attention sinks are split with the q heads). The model is built
with the rank's local geometry (`local_config`), then its split layers are swapped in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.distributed.layers import (
    ColumnParallelLinear,
    ExpertParallelSlices,
    GptOssExpertSlices,
    QueryHeadRows,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from sprig.runtime.distributed.norm import HeadParallelRMSNorm
from sprig.runtime.layers.attention import SelfAttention
from sprig.runtime.layers.embedding import LMHead, VocabEmbedding
from sprig.runtime.layers.mlp import GatedMLP
from sprig.runtime.layers.moe import FusedExperts, GptOssExperts
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import model_class


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds of a model of geometry `full`; ValueError if the
    model does not split over `size` ranks."""

    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.full, self.size
        why_not = getattr(model_class(c.architecture), "not_tensor_parallel", None)
        if n > 1 and why_not:
            raise ValueError(f"tensor parallelism: {c.architecture} does not split over ranks: {why_not}")
        if c.num_heads % n:
            raise ValueError(f"tensor parallelism: {c.num_heads} attention heads do not split over {n} ranks")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ValueError(
                f"tensor parallelism: {c.num_kv_heads} KV heads neither split over {n} ranks nor replicate evenly"
            )
        if c.intermediate_size % n:
            raise ValueError(f"tensor parallelism: intermediate size {c.intermediate_size} does not split over {n} ranks")
        if c.moe is not None:
            for what, size in (("expert intermediate size", c.moe.expert_intermediate_size),
                               ("shared expert intermediate size", c.moe.shared_expert_intermediate_size)):
                if size % n:
                    raise ValueError(f"tensor parallelism: {what} {size} does not split over {n} ranks")
            inter, block = c.moe.expert_intermediate_size, GptOssExperts.MXFP4_GROUP
            if c.moe.expert_format == "mxfp4" and inter // n % block:
                raise ValueError(
                    f"tensor parallelism: MXFP4 experts pack their down projection's inputs in blocks of {block}; "
                    f"an expert intermediate size of {inter} over {n} ranks is {inter // n} per rank, "
                    f"not whole blocks (choose a --tp-size that leaves each rank a multiple of {block})"
                )
        if c.vocab_size < n:
            raise ValueError(f"tensor parallelism: a vocabulary of {c.vocab_size} does not split over {n} ranks")

    @property
    def kv_heads(self) -> int:
        return max(self.full.num_kv_heads // self.size, 1)

    @property
    def kv_start(self) -> int:
        """The first KV head this rank holds."""
        return self.rank * self.full.num_kv_heads // self.size

    def vocab_sizes(self) -> list[int]:
        base, extra = divmod(self.full.vocab_size, self.size)
        return [base + (r < extra) for r in range(self.size)]

    def local_config(self) -> ModelConfig:
        """The geometry of this rank's part: the KV pool and attention backend use it."""
        c = self.full
        moe = c.moe and replace(c.moe, expert_intermediate_size=c.moe.expert_intermediate_size // self.size,
                                shared_expert_intermediate_size=c.moe.shared_expert_intermediate_size // self.size)
        return replace(c, num_heads=c.num_heads // self.size, num_kv_heads=self.kv_heads,
                       intermediate_size=c.intermediate_size // self.size,
                       vocab_size=self.vocab_sizes()[self.rank], moe=moe)


def build_sharded(config: ModelConfig, group: TPGroup) -> nn.Module:
    """The registered model for `config`, holding rank `group.rank`'s part (on the current
    default device, e.g. meta, uninitialised)."""
    plan = ShardPlan(config, group.rank, group.size)
    model = model_class(config.architecture)(plan.local_config())
    model.config = config
    for name, module in list(model.named_modules()):
        split = SPLITTERS.get(type(module))
        if split is not None:
            replacement = split(module, plan, group)
            if replacement is not module:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, replacement)
    return model


def _attention(attn: SelfAttention, plan: ShardPlan, group: TPGroup) -> SelfAttention:
    D, q_rows = attn.head_dim, attn.num_heads * attn.head_dim
    kv_start = plan.kv_start * D
    attn.qkv_proj = ColumnParallelLinear(
        plan.full.hidden_size, attn.qkv_proj.out_sizes, bias=attn.qkv_proj.bias is not None,
        starts={"q": plan.rank * q_rows, "k": kv_start, "v": kv_start},
        full_sizes={"q": plan.full.num_heads * D, "k": plan.full.num_kv_heads * D, "v": plan.full.num_kv_heads * D},
    )
    attn.o_proj = RowParallelLinear(q_rows, plan.full.hidden_size, bias=attn.o_proj.bias is not None, group=group)
    if attn.sinks is not None:  # gpt-oss's, one per query head
        attn.checkpoint_index = QueryHeadRows(plan.rank * attn.num_heads, attn.num_heads)
    if attn.norm_whole and attn.q_norm is not None and attn.k_norm is not None:  # OLMo's: over all heads at once
        eps = attn.q_norm.eps
        attn.q_norm = HeadParallelRMSNorm(q_rows, eps, start=plan.rank * q_rows, group=group)
        attn.k_norm = HeadParallelRMSNorm(attn.num_kv_heads * D, eps, start=kv_start, group=group)
    return attn


def _mlp(mlp: GatedMLP, plan: ShardPlan, group: TPGroup) -> GatedMLP:
    rows = mlp.gate_up_proj.out_sizes["gate"]  # this rank's (of a dense MLP's or a shared expert's)
    start = plan.rank * rows
    mlp.gate_up_proj = ColumnParallelLinear(
        plan.full.hidden_size, mlp.gate_up_proj.out_sizes, bias=mlp.gate_up_proj.bias is not None,
        starts={"gate": start, "up": start},
        full_sizes={"gate": rows * plan.size, "up": rows * plan.size},
    )
    mlp.down_proj = RowParallelLinear(rows, plan.full.hidden_size, bias=mlp.down_proj.bias is not None, group=group)
    return mlp


def _experts(experts: FusedExperts, plan: ShardPlan, group: TPGroup) -> nn.Module:
    rows = experts.intermediate_size  # this rank's
    return ExpertParallelSlices(experts.num_experts, plan.full.hidden_size, rows, start=plan.rank * rows, group=group)


def _gpt_oss_experts(experts: GptOssExperts, plan: ShardPlan, group: TPGroup) -> nn.Module:
    moe = plan.local_config().moe  # this rank's intermediate size
    return GptOssExpertSlices(plan.full.hidden_size, moe, start=plan.rank * moe.expert_intermediate_size, group=group)


def _embedding(embedding: VocabEmbedding, plan: ShardPlan, group: TPGroup) -> nn.Module:
    sizes = plan.vocab_sizes()
    return VocabParallelEmbedding(sizes[plan.rank], plan.full.hidden_size, start=sum(sizes[: plan.rank]), group=group)


def _lm_head(head: LMHead, plan: ShardPlan, group: TPGroup) -> nn.Module:
    return VocabParallelLMHead(plan.vocab_sizes(), plan.full.hidden_size, tied=head.weight is None, group=group)


SPLITTERS = {SelfAttention: _attention, GatedMLP: _mlp, FusedExperts: _experts, GptOssExperts: _gpt_oss_experts,
             VocabEmbedding: _embedding, LMHead: _lm_head}
