"""What each tensor-parallel rank holds, checked without processes: the rank's model,
loaded from the checkpoint as its slices, against slices of the whole model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from sprig.runtime.distributed.shard import ShardPlan
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint
from sprig.runtime.weight_loader import load_model


@dataclass
class Ranks:  # what loading needs of a group: no collective runs while weights load
    rank: int
    size: int


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


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_is_refused_with_the_reason(arch: str, tiny_checkpoints: dict[str, Path]) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints[arch])
    assert ShardPlan(config, 0, 1).local_config() == config
    with pytest.raises(ValueError, match=r"ForCausalLM does not split over ranks: its q and k norms span all heads"):
        ShardPlan(config, 0, 2)
