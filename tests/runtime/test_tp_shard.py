"""What each tensor-parallel rank holds, checked without processes: the rank's model,
loaded from the checkpoint as its slices, against slices of the whole model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from gpt_oss_checkpoints import biased_copy, mxfp4_pair

from sprig.kernels.moe import route_topk
from sprig.kernels.mxfp4 import dequantize_mxfp4
from sprig.runtime.distributed.shard import ShardPlan
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint
from sprig.runtime.weight_loader import load_model


@dataclass
class Ranks:  # what loading needs of a group: no collective runs while weights load
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # one rank's part: the test sums them
        return x


def load(path: Path, tp: Ranks | None = None) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(path)
    return load_model(config, path, dtype=torch.float32, device=torch.device("cpu"), tp=tp)


@pytest.fixture(scope="module")
def gqa1_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("shard") / "m", "qwen2", num_key_value_heads=1,
                                 tie_word_embeddings=True, vocab_size=301)


# phi3 and phi4_mini: checkpoints with fused qkv_proj / gate_up_proj tensors, cut into
# shards and then into the rank's rows; at 4 ranks each of their 2 KV heads is replicated
@pytest.mark.parametrize(("name", "size"), [("qwen2", 2), ("qwen2", 4), ("gqa1", 2), ("gqa1", 4), ("phi3", 4),
                                            ("phi4_mini", 2)])
def test_each_rank_holds_its_slices(name: str, size: int, tiny_checkpoints: dict[str, Path], gqa1_tied: Path) -> None:
    path = gqa1_tied if name == "gqa1" else tiny_checkpoints[name]
    full = load(path)
    config = full.config
    D, Hq, Hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    q_rows = Hq // size * D
    vocab = []
    for rank in range(size):
        plan = ShardPlan(config, rank, size)
        part = load(path, Ranks(rank, size))
        for a, b in zip(part.model.layers, full.model.layers, strict=True):
            kv = slice(plan.kv_start * D, (plan.kv_start + plan.kv_heads) * D)  # within k, and within v
            q, k, v = (b.self_attn.qkv_proj.weight[b.self_attn.qkv_proj.shard_rows(s)] for s in "qkv")
            want = torch.cat([q[rank * q_rows : (rank + 1) * q_rows], k[kv], v[kv]])
            assert torch.equal(a.self_attn.qkv_proj.weight, want)
            if b.self_attn.qkv_proj.bias is not None:
                qb, kb, vb = (b.self_attn.qkv_proj.bias[b.self_attn.qkv_proj.shard_rows(s)] for s in "qkv")
                assert torch.equal(a.self_attn.qkv_proj.bias,
                                   torch.cat([qb[rank * q_rows : (rank + 1) * q_rows], kb[kv], vb[kv]]))
            assert torch.equal(a.self_attn.o_proj.weight, b.self_attn.o_proj.weight[:, rank * q_rows : (rank + 1) * q_rows])
            cols = slice(rank * inter // size, (rank + 1) * inter // size)
            gate, up = (b.mlp.gate_up_proj.weight[b.mlp.gate_up_proj.shard_rows(s)] for s in ("gate", "up"))
            assert torch.equal(a.mlp.gate_up_proj.weight, torch.cat([gate[cols], up[cols]]))
            assert torch.equal(a.mlp.down_proj.weight, b.mlp.down_proj.weight[:, cols])
            assert torch.equal(a.input_layernorm.weight, b.input_layernorm.weight)
        rows = part.model.embed_tokens.weight
        if config.tie_word_embeddings:
            assert part.lm_head.weight is None  # the head reads the embedding's rows
        else:
            assert torch.equal(part.lm_head.weight, full.lm_head.weight[part.lm_head.start :][: rows.shape[0]])
        vocab.append(rows)
        if Hkv < size:  # the KV head this rank's q heads read
            assert plan.kv_start == rank * Hq // size // (Hq // Hkv)
    assert torch.equal(torch.cat(vocab), full.model.embed_tokens.weight)  # 301 rows, split unevenly
    assert len({w.shape[0] for w in vocab}) == (1 if config.vocab_size % size == 0 else 2)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_every_experts_slice(size: int, tiny_checkpoints: dict[str, Path]) -> None:
    """Qwen2-MoE: each expert's gate and up rows and down columns `rank * I/n ..`, the shared
    expert split like an MLP, the router and the shared expert's gate whole."""
    path = tiny_checkpoints["qwen2_moe"]
    full = load(path)
    moe = full.config.moe
    for rank in range(size):
        part = load(path, Ranks(rank, size))
        for a, b in zip(part.model.layers, full.model.layers, strict=True):
            inter = moe.expert_intermediate_size
            cols = slice(rank * inter // size, (rank + 1) * inter // size)
            gate, up = b.mlp.experts.gate_up_proj[:, :inter], b.mlp.experts.gate_up_proj[:, inter:]
            assert torch.equal(a.mlp.experts.gate_up_proj, torch.cat([gate[:, cols], up[:, cols]], dim=1))
            assert torch.equal(a.mlp.experts.down_proj, b.mlp.experts.down_proj[:, :, cols])
            shared = moe.shared_expert_intermediate_size
            cols = slice(rank * shared // size, (rank + 1) * shared // size)
            sg, su = (b.mlp.shared_expert.gate_up_proj.weight[b.mlp.shared_expert.gate_up_proj.shard_rows(s)]
                      for s in ("gate", "up"))
            assert torch.equal(a.mlp.shared_expert.gate_up_proj.weight, torch.cat([sg[cols], su[cols]]))
            assert torch.equal(a.mlp.shared_expert.down_proj.weight, b.mlp.shared_expert.down_proj.weight[:, cols])
            assert torch.equal(a.mlp.gate.weight, b.mlp.gate.weight)
            assert torch.equal(a.mlp.shared_expert_gate.weight, b.mlp.shared_expert_gate.weight)


def test_experts_that_do_not_split_are_refused(tiny_checkpoints: dict[str, Path]) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints["qwen3_moe"])  # experts of 64 features
    with pytest.raises(ValueError, match="expert intermediate size 64 does not split over 3 ranks"):
        ShardPlan(replace(config, num_heads=6, num_kv_heads=3, intermediate_size=96), 0, 3)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_heads_of_olmos_q_and_k_norms(size: int, tiny_checkpoints: dict[str, Path]) -> None:
    """OLMo 2's norms over whole projections hold the weight of the rank's q heads and KV
    heads (at 4 ranks each of the 2 KV heads is replicated on two), and divide the squares
    summed over the ranks by the projection's width times the ranks holding each feature."""
    path = tiny_checkpoints["olmo2"]
    full = load(path)
    config = full.config
    D, q_rows = config.head_dim, config.num_heads // size * config.head_dim
    for rank in range(size):
        plan = ShardPlan(config, rank, size)
        part = load(path, Ranks(rank, size))
        kv = slice(plan.kv_start * D, (plan.kv_start + plan.kv_heads) * D)
        for a, b in zip(part.model.layers, full.model.layers, strict=True):
            assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight[rank * q_rows : (rank + 1) * q_rows])
            assert torch.equal(a.self_attn.k_norm.weight, b.self_attn.k_norm.weight[kv])
            replicas = size // config.num_kv_heads if size > config.num_kv_heads else 1
            assert a.self_attn.k_norm.count == replicas * config.num_kv_heads * D
            assert a.self_attn.q_norm.count == config.num_heads * D


@pytest.fixture(scope="module")
def gpt_oss(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny gpt-oss (experts of 64 features) with every bias drawn, and its MXFP4 form."""
    root = tmp_path_factory.mktemp("gpt_oss")
    biased = biased_copy(tiny_checkpoints["gpt_oss"], root / "biased", seed=1)
    return {"float": biased, "mxfp4": mxfp4_pair(biased, root)[0]}


def _expert_weights(experts: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:  # [E, 2I, H], [E, H, I]
    if not experts.mxfp4:
        return experts.gate_up_proj, experts.down_proj
    return (dequantize_mxfp4(experts.gate_up_proj_blocks, experts.gate_up_proj_scales, torch.float32),
            dequantize_mxfp4(experts.down_proj_blocks, experts.down_proj_scales, torch.float32))


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_each_rank_holds_its_gpt_oss_slices(kind: str, gpt_oss: dict[str, Path]) -> None:
    """gpt-oss at 2 ranks: the sinks of the rank's q heads; each expert's gate and up of
    features `rank * I/n ..` (rows 2j and 2j + 1 for feature j: interleaved) with their
    biases, its down inputs of those features (MXFP4: whole blocks of codes and scales);
    the router and the o and down biases whole. The ranks' expert outputs (rank 0's with
    the down bias) sum to the whole layer's."""
    path, size = gpt_oss[kind], 2
    full = load(path)
    config = full.config
    heads, inter = config.num_heads // size, config.moe.expert_intermediate_size // size
    parts = [load(path, Ranks(rank, size)) for rank in range(size)]
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, b in enumerate(full.model.layers):
        weights, ids = route_topk(b.mlp.router(x), config.moe.top_k, renormalize=True)
        total = torch.zeros_like(x)
        for rank, part in enumerate(parts):
            a = part.model.layers[i]
            assert torch.equal(a.self_attn.sinks, b.self_attn.sinks[rank * heads : (rank + 1) * heads])
            assert torch.equal(a.self_attn.o_proj.bias, b.self_attn.o_proj.bias)
            assert torch.equal(a.mlp.router.weight, b.mlp.router.weight)
            assert torch.equal(a.mlp.router.bias, b.mlp.router.bias)
            cols = slice(rank * inter, (rank + 1) * inter)
            (gate_up, down), (whole_gate_up, whole_down) = _expert_weights(a.mlp.experts), _expert_weights(b.mlp.experts)
            for first in (0, 1):  # gate rows, then up rows
                assert torch.equal(gate_up[:, first::2], whole_gate_up[:, first::2][:, cols])
                assert torch.equal(a.mlp.experts.gate_up_proj_bias[:, first::2],
                                   b.mlp.experts.gate_up_proj_bias[:, first::2][:, cols])
            assert torch.equal(down, whole_down[:, :, cols])
            assert torch.equal(a.mlp.experts.down_proj_bias, b.mlp.experts.down_proj_bias)
            total += a.mlp.experts(x, weights, ids)
        torch.testing.assert_close(total, b.mlp.experts(x, weights, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_gpt_oss_rank_experts_sum_to_the_whole_in_the_triton_kernel(kind: str, gpt_oss: dict[str, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton expert kernel (on CUDA, else in Triton's interpreter) over each rank's
    slices, rank 0's with the down bias, sums to its output over the whole experts: nothing
    in it assumes the whole intermediate size."""
    monkeypatch.setenv("SPRIG_FORCE_TRITON", "1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tol = {"atol": 0.05, "rtol": 0.01} if device.type == "cuda" else {"atol": 1e-5, "rtol": 0.0}  # CUDA: tf32 dots
    path, size = gpt_oss[kind], 2
    whole = load(path).model.layers[0].mlp
    parts = [load(path, Ranks(rank, size)).model.layers[0].mlp.experts.to(device) for rank in range(size)]
    x = torch.randn(9, whole.router.in_features, generator=torch.Generator().manual_seed(1))
    weights, ids = route_topk(whole.router(x), whole.top_k, renormalize=True)
    x, weights, ids = x.to(device), weights.to(device), ids.to(device)
    total = sum(experts(x, weights, ids) for experts in parts)
    torch.testing.assert_close(total, whole.experts.to(device)(x, weights, ids), **tol)
