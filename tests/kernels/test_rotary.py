"""RoPE: tables and rotation against HF Llama; the Triton kernel against the reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from sprig.kernels import apply_rotary, apply_rotary_ref, rope_cos_sin
from sprig.runtime.layers.rotary import RotaryEmbedding

LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
SCALINGS: list[tuple[dict[str, Any] | None, str]] = [
    (None, "default"),
    ({"rope_type": "default"}, "default"),
    ({"rope_type": "linear", "factor": 4.0}, "linear"),
    ({"type": "linear", "factor": 2.0}, "linear"),
    (LLAMA3, "llama3"),
]


def _hf_rotary(head_dim: int, base: float, scaling: dict[str, Any] | None,
               max_pos: int) -> LlamaRotaryEmbedding:
    heads = 4
    config = LlamaConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=max_pos, rope_theta=base,
        rope_scaling=dict(scaling) if scaling is not None else None,
    )
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize(("scaling", "rope_type"), SCALINGS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tables_and_rotation_match_hf(
    scaling: dict[str, Any] | None, rope_type: str, head_dim: int
) -> None:
    base, max_pos = 500000.0, 1024
    hf = _hf_rotary(head_dim, base, scaling, max_pos)
    assert hf.rope_type == rope_type  # the HF side really applies the scaling under test
    torch.manual_seed(0)
    T = 9
    positions = torch.tensor([0, 1, 2, 127, 128, 129, 500, 1023, 7])
    q = torch.randn(T, 4, head_dim)
    k = torch.randn(T, 2, head_dim)
    hf_cos, hf_sin = hf(q, positions[None])  # [1, T, D]
    cos, sin = rope_cos_sin(head_dim, max_pos, base=base, scaling=scaling, device="cpu")
    assert cos.shape == (max_pos, head_dim)
    torch.testing.assert_close(cos[positions], hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[positions], hf_sin[0], atol=1e-6, rtol=0)
    # HF layout [batch, heads, T, D]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  hf_cos, hf_sin)
    q_out, k_out = apply_rotary_ref(torch.cat([q, k], dim=1), positions, cos, sin).split([4, 2], dim=1)
    torch.testing.assert_close(q_out, hq[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, hk[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_rotation_is_exact_given_the_same_table() -> None:
    hf = _hf_rotary(64, 10000.0, None, 64)
    torch.manual_seed(1)
    positions = torch.arange(5) * 3
    q, k = torch.randn(5, 4, 64), torch.randn(5, 4, 64)
    cos, sin = hf(q, positions[None])
    full_cos = torch.zeros(64, 64).index_copy_(0, positions, cos[0])
    full_sin = torch.zeros(64, 64).index_copy_(0, positions, sin[0])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(apply_rotary_ref(q, positions, full_cos, full_sin), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary_ref(k, positions, full_cos, full_sin), hk[0].transpose(0, 1))


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain, _ = rope_cos_sin(128, 256, base=500000.0, scaling=None)
    scaled, _ = rope_cos_sin(128, 256, base=500000.0, scaling=LLAMA3)
    assert torch.equal(plain[:, 0], scaled[:, 0])  # highest frequency untouched
    assert not torch.equal(plain[:, 63], scaled[:, 63])


def test_unknown_rope_type_raises() -> None:
    with pytest.raises(ValueError, match="rope_type"):
        rope_cos_sin(64, 8, base=10000.0, scaling={"rope_type": "dynamic", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hk", "head_dim"), [(4, 4, 64), (8, 2, 128), (5, 1, 64)])
def test_triton_matches_ref(
    dtype: torch.dtype, hq: int, hk: int, head_dim: int,
    device: str, force_triton: None, tol: dict,
) -> None:
    torch.manual_seed(2)
    T = 7
    cos, sin = rope_cos_sin(head_dim, 300, base=10000.0, scaling=LLAMA3)
    positions = torch.tensor([0, 299, 5, 5, 128, 17, 1])
    # q's and k's heads side by side, a view into one fused projection, as the model rotates them
    qkv = torch.randn(T, (hq + 2 * hk) * head_dim, dtype=dtype)
    qk = qkv[:, : (hq + hk) * head_dim].view(T, hq + hk, head_dim)
    expected = apply_rotary_ref(qk, positions, cos, sin)
    qkv_d = qkv.to(device)
    qk_d = qkv_d[:, : (hq + hk) * head_dim].view(T, hq + hk, head_dim)
    got = apply_rotary(qk_d, positions.to(device), cos.to(device), sin.to(device))
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])
    assert torch.equal(qkv_d.cpu(), qkv)  # input untouched


def test_the_module_gathers_a_steps_rows_once_and_never_serves_stale_ones() -> None:
    torch.manual_seed(3)
    rotary = RotaryEmbedding(32, 200, base=10000.0, scaling=LLAMA3)
    x = torch.randn(5, 6, 32)
    for positions in (torch.tensor([0, 7, 7, 150, 3]), torch.tensor([1, 2, 3, 4, 199])):
        want = apply_rotary_ref(x, positions, rotary.cos, rotary.sin)
        assert torch.equal(rotary(positions, x), want)
        rows = rotary._rows
        assert torch.equal(rotary(positions, x[:, :2]), want[:, :2])  # another layer, same step
        assert rotary._rows is rows
    assert torch.equal(rotary(positions.clone(), x), want)  # equal positions, another step
    assert rotary._rows is not rows
