"""YaRN cos/sin tables against transformers' own: its `ROPE_INIT_FUNCTIONS["yarn"]`
(inverse frequencies and attention factor) and a Qwen3 rotary module's cos/sin."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from sprig.kernels import rope_cos_sin

MAX_POS = 512
# (base, head_dim, rope dict): every key transformers' yarn reads, each away from its default somewhere
CASES: dict[str, tuple[float, int, dict[str, Any]]] = {
    "qwen-128k": (1e6, 128, {"factor": 4.0, "original_max_position_embeddings": 128}),
    "tiny-original": (1e4, 64, {"factor": 8.0, "original_max_position_embeddings": 16}),
    "betas": (1e4, 64, {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2}),
    "betas-null": (1e4, 64, {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": None,
                             "beta_slow": None}),
    "no-truncate": (1e4, 64, {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False}),
    "deepseek-mscale": (1e4, 64, {"factor": 40.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                                  "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "mscale-alone": (1e4, 64, {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.5}),
    "attention-factor": (5e5, 64, {"factor": 2.0, "original_max_position_embeddings": 64,
                                   "attention_factor": 0.8}),
    "factor-below-1": (1e4, 64, {"factor": 0.5, "original_max_position_embeddings": 64}),
    "int-factor": (1e4, 32, {"factor": 3, "original_max_position_embeddings": 100}),
}


def _hf_config(base: float, head_dim: int, rope: dict[str, Any]) -> Qwen3Config:
    return Qwen3Config(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=MAX_POS, rope_parameters={"rope_type": "yarn", "rope_theta": base, **rope},
    )


def _hf_tables(base: float, head_dim: int, rope: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """transformers' cos, sin [MAX_POS, D] (its init function's inv_freq and attention
    factor, applied as its rotary modules do) and the attention factor."""
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(base, head_dim, rope), "cpu")
    freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor, factor


@pytest.mark.parametrize("case", CASES)
def test_tables_equal_transformers_yarn(case: str) -> None:
    base, head_dim, rope = CASES[case]
    hf_cos, hf_sin, factor = _hf_tables(base, head_dim, rope)
    cos, sin = rope_cos_sin(head_dim, MAX_POS, base=base, scaling={"rope_type": "yarn", **rope})
    assert cos.dtype == torch.float32 and cos.shape == (MAX_POS, head_dim)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)
    assert cos[0, 0].item() == pytest.approx(factor)  # the attention factor really scales the table


@pytest.mark.parametrize("case", ["qwen-128k", "deepseek-mscale", "no-truncate"])
def test_tables_equal_a_qwen3_rotary_module(case: str) -> None:
    base, head_dim, rope = CASES[case]
    hf = Qwen3RotaryEmbedding(_hf_config(base, head_dim, rope))
    assert hf.rope_type == "yarn"
    positions = torch.tensor([0, 1, 15, 16, 17, 63, 64, 65, 200, MAX_POS - 1])
    hf_cos, hf_sin = hf(torch.empty(1, dtype=torch.float32), positions[None])  # [1, T, D]
    cos, sin = rope_cos_sin(head_dim, MAX_POS, base=base, scaling={"type": "yarn", **rope})
    assert torch.equal(cos[positions], hf_cos[0]) and torch.equal(sin[positions], hf_sin[0])


def test_the_attention_factors_are_the_yarn_papers() -> None:
    """Independent of transformers: 0.1 ln(s) + 1, DeepSeek's ratio, or the given one."""
    expect = {
        "qwen-128k": 0.1 * math.log(4) + 1,
        "deepseek-mscale": (0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1),
        "mscale-alone": 0.1 * math.log(4) + 1,  # mscale counts only together with mscale_all_dim
        "attention-factor": 0.8,
        "factor-below-1": 1.0,
    }
    for case, factor in expect.items():
        base, head_dim, rope = CASES[case]
        cos, sin = rope_cos_sin(head_dim, 8, base=base, scaling={"rope_type": "yarn", **rope})
        assert torch.allclose(cos.square() + sin.square(), torch.full_like(cos, factor**2), rtol=1e-5), case


def test_yarn_keeps_high_frequencies_and_interpolates_low_ones() -> None:
    base, head_dim, rope = CASES["tiny-original"]
    plain, _ = rope_cos_sin(head_dim, 64, base=base, scaling=None)
    cos, _ = rope_cos_sin(head_dim, 64, base=base, scaling={"rope_type": "yarn", **rope, "attention_factor": 1.0})
    linear, _ = rope_cos_sin(head_dim, 64, base=base, scaling={"rope_type": "linear", "factor": rope["factor"]})
    assert torch.equal(cos[:, 0], plain[:, 0])  # fastest dimension: extrapolated, untouched
    torch.testing.assert_close(cos[:, head_dim // 2 - 1], linear[:, head_dim // 2 - 1], atol=1e-6, rtol=0)
    assert not torch.allclose(cos[:, head_dim // 2 - 1], plain[:, head_dim // 2 - 1])
