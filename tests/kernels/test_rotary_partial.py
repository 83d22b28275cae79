"""Partial rotary (tables narrower than the head: Phi-4-mini's `partial_rotary_factor`) and
longrope tables: the Triton kernel against the torch reference, the reference against
transformers' Phi-3 rotation, the tables against transformers' longrope."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from sprig.kernels import apply_rotary, apply_rotary_ref, rope_cos_sin
from sprig.runtime.tiny_checkpoint import longrope_parameters

ORIGINAL = 32  # the longrope tests' original_max_position_embeddings


def _tables(rotary_dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    scaling = {**longrope_parameters(rotary_dim, factor=8.0), "original_max_position_embeddings": ORIGINAL}
    return rope_cos_sin(rotary_dim, max_pos, base=10000.0, scaling=scaling)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hk", "head_dim", "rotary_dim"),
                         [(4, 2, 16, 12), (3, 1, 64, 48), (2, 2, 128, 96), (4, 4, 64, 64)])
def test_triton_matches_ref(
    dtype: torch.dtype, hq: int, hk: int, head_dim: int, rotary_dim: int,
    device: str, force_triton: None, tol: dict,
) -> None:
    """q's and k's heads side by side, a view into one fused projection; the unrotated
    tail of each head is copied bit for bit."""
    torch.manual_seed(0)
    T = 5
    cos, sin = _tables(rotary_dim, 40)
    positions = torch.tensor([0, 39, 5, 5, 31])
    qkv = torch.randn(T, (hq + 2 * hk) * head_dim, dtype=dtype)
    qk = qkv[:, : (hq + hk) * head_dim].view(T, hq + hk, head_dim)
    expected = apply_rotary_ref(qk, positions, cos, sin)
    qkv_d = qkv.to(device)
    got = apply_rotary(qkv_d[:, : (hq + hk) * head_dim].view(T, hq + hk, head_dim), positions.to(device),
                       cos.to(device), sin.to(device)).cpu()
    torch.testing.assert_close(got, expected, **tol[dtype])
    assert torch.equal(got[..., rotary_dim:], qk[..., rotary_dim:])
    assert torch.equal(qkv_d.cpu(), qkv)  # input untouched


def test_ref_equals_transformers_phi3_rotation() -> None:
    torch.manual_seed(1)
    head_dim, rotary_dim, T = 16, 12, 6
    cos, sin = _tables(rotary_dim, 64)
    positions = torch.tensor([0, 3, 17, 40, 63, 1])
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, 2, head_dim)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  cos[positions][None], sin[positions][None])
    assert torch.equal(apply_rotary_ref(q, positions, cos, sin), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary_ref(k, positions, cos, sin), hk[0].transpose(0, 1))
    assert not torch.equal(hq[0, :, 1:, :rotary_dim], q.transpose(0, 1)[:, 1:, :rotary_dim])  # rotated


def _hf_longrope(rope: dict[str, Any], max_pos: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=max_pos,
                        original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                        rope_parameters=dict(rope))
    return ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("extra", [{}, {"factor": 3.0}, {"attention_factor": 0.9}], ids=["ratio", "factor", "attention"])
@pytest.mark.parametrize("max_positions", [ORIGINAL, ORIGINAL + 1, 128])
def test_longrope_tables_equal_transformers(extra: dict[str, Any], max_positions: int) -> None:
    """Short factors for a table within the original length, long ones past it; the
    attention factor from `attention_factor`, `factor`, or transformers' length ratio
    (128 / 32: max_position_embeddings over the original, filled as `ModelConfig` does)."""
    rope = longrope_parameters(12, **extra)
    hf_inv_freq, hf_factor = _hf_longrope(rope, 128, seq_len=max_positions)
    filled = {"factor": 128 / ORIGINAL, **rope, "original_max_position_embeddings": ORIGINAL}
    cos, sin = rope_cos_sin(12, max_positions, base=10000.0, scaling=filled)
    freqs = torch.arange(max_positions).float()[:, None] * hf_inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    assert cos.shape == (max_positions, 12)
    assert torch.equal(cos, emb.cos() * hf_factor) and torch.equal(sin, emb.sin() * hf_factor)
    short, _ = _hf_longrope(rope, 128, seq_len=None)
    assert torch.equal(hf_inv_freq, short) == (max_positions <= ORIGINAL)  # the choice really differs
    assert hf_factor != 1.0
