"""Rotary position embeddings, neox / Hugging Face `rotate_half` style.

`rope_cos_sin` builds the HF cos/sin tables ([P, R], frequencies concatenated twice, times
the rope type's attention factor); `apply_rotary` rotates heads (q's, k's, or both side by
side) by the table rows at `positions`. The table's width R (even, at most the head size D)
is how many leading dimensions of each head rotate (partial rotary, Phi-4-mini's
`partial_rotary_factor`); the other D - R pass through unchanged:
    out[:R] = x[:R] * cos + rotate_half(x[:R]) * sin,   rotate_half(y) = cat(-y[R/2:], y[:R/2])
    out[R:] = x[R:]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch

from ._dispatch import next_pow2, use_triton
from ._triton import tl, triton


def _wavelength_powers(head_dim: int, base: float, device: torch.device | str | None) -> torch.Tensor:
    """base ** (2i / D) for i < D/2, in float32: the reciprocal of plain RoPE's frequencies."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return base ** (exponent / head_dim)  # [D/2]


def _plain(head_dim: int, base: float, scaling: dict[str, Any], max_positions: int,
           device: torch.device | str | None) -> tuple[torch.Tensor, float]:
    return 1.0 / _wavelength_powers(head_dim, base, device), 1.0


def _linear(head_dim: int, base: float, scaling: dict[str, Any], max_positions: int,
            device: torch.device | str | None) -> tuple[torch.Tensor, float]:
    return 1.0 / _wavelength_powers(head_dim, base, device) / scaling["factor"], 1.0


def _llama3(head_dim: int, base: float, scaling: dict[str, Any], max_positions: int,
            device: torch.device | str | None) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / _wavelength_powers(head_dim, base, device)
    factor = scaling["factor"]
    low_ff = scaling["low_freq_factor"]
    high_ff = scaling["high_freq_factor"]
    old_len = scaling.get("original_max_position_embeddings", max_positions)
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The cos/sin multiplier: `attention_factor` when given, else 0.1 ln(factor) + 1
    (DeepSeek's ratio of that with `mscale` over that with `mscale_all_dim` when both are
    set), and 1 for a factor <= 1."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling["factor"]

    def magnitude(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(magnitude(mscale) / magnitude(mscale_all_dim))
    return magnitude(1)


def _yarn(head_dim: int, base: float, scaling: dict[str, Any], max_positions: int,
          device: torch.device | str | None) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions turning more than `beta_fast` times over the original context keep
    their frequency, those turning fewer than `beta_slow` times are divided by `factor`,
    with a linear blend between (its ends rounded outwards to whole dimensions unless
    `truncate` is false)."""
    factor = scaling["factor"]
    old_len = scaling.get("original_max_position_embeddings", max_positions)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the (fractional) dimension index that turns `turns` times
        return (head_dim * math.log(old_len / (turns * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_turning(fast), dim_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp).to(device=device, dtype=torch.float)  # [D/2], 1 where the frequency is kept
    powers = _wavelength_powers(head_dim, base, device)
    inv_freq = 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep
    return inv_freq, _yarn_attention_factor(scaling)


def _longrope(head_dim: int, base: float, scaling: dict[str, Any], max_positions: int,
              device: torch.device | str | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3/Phi-4): plain RoPE with each frequency divided by its own factor, one
    set of factors for the whole table: `long_factor` when the table reaches past
    `original_max_position_embeddings` (max_positions > it), else `short_factor`. The
    cos/sin multiplier is `attention_factor` when given, else sqrt(1 + ln(factor) /
    ln(original)) for a `factor` > 1, else 1."""
    original = scaling["original_max_position_embeddings"]
    chosen = scaling["long_factor"] if max_positions > original else scaling["short_factor"]
    ext = torch.tensor(chosen, dtype=torch.float32, device=device)  # [D/2]
    inv_freq = 1.0 / (ext * _wavelength_powers(head_dim, base, device))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling["factor"]
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, attention_factor


# (head_dim, base, scaling, max_positions, device) -> (inv_freq [D/2] float32, cos/sin multiplier)
_RopeInit = Callable[[int, float, dict[str, Any], int, "torch.device | str | None"], tuple[torch.Tensor, float]]
_ROPE_TYPES: MappingProxyType[str, _RopeInit] = MappingProxyType({
    "default": _plain, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope,
})


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    *,
    base: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_positions, head_dim]
    """HF cos/sin tables for positions 0..max_positions-1, computed in float32 with exactly
    transformers' operations per rope type (`ROPE_INIT_FUNCTIONS`), then cast. `head_dim`
    is the rotated width (a head's size times its partial rotary factor).

    `scaling` is None or a dict whose `rope_type` (or `type`) is default, linear, llama3,
    yarn or longrope, with that type's transformers keys; a missing
    `original_max_position_embeddings` means `max_positions` (longrope needs it). Yarn's
    `factor` must be a number, and so must longrope's unless `attention_factor` is given
    (`ModelConfig` fills both). Longrope's factors are chosen once for the whole table by
    `max_positions` (`_longrope`), where transformers chooses per forward call by its
    longest position: the tables equal transformers' for every forward whose positions
    all lie on the chosen side of `original_max_position_embeddings`."""
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} ({', '.join(_ROPE_TYPES)})")
    inv_freq, attention_factor = _ROPE_TYPES[rope_type](head_dim, base, scaling or {}, max_positions, device)
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D], last dim contiguous
    out_ptr,  # [T, H, D] contiguous
    pos_ptr,  # [T] int64
    cos_ptr,  # [P, 2 HALF] contiguous
    sin_ptr,  # [P, 2 HALF] contiguous
    H,
    stride_xt,
    stride_xh,
    HALF: tl.constexpr,
    D: tl.constexpr,  # >= 2 HALF; dims 2 HALF .. D-1 are copied unrotated
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # next_pow2(D - 2 HALF); unused when D == 2 HALF
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    d = tl.arange(0, BLOCK_HALF)  # [BD]
    dmask = d < HALF
    mask = (heads[:, None] < H) & dmask[None, :]
    cos1 = tl.load(cos_ptr + pos * (2 * HALF) + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * (2 * HALF) + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * (2 * HALF) + d, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * (2 * HALF) + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [BH, BD]
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    obase = out_ptr + t * H * D + heads[:, None] * D + d[None, :]
    tl.store(obase, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if D > 2 * HALF:  # partial rotary: the unrotated tail of each head
        p = tl.arange(0, BLOCK_PASS)
        pmask = (heads[:, None] < H) & (p[None, :] < D - 2 * HALF)
        tail = x_ptr + t * stride_xt + heads[:, None] * stride_xh + 2 * HALF + p[None, :]
        otail = out_ptr + t * H * D + heads[:, None] * D + 2 * HALF + p[None, :]
        tl.store(otail, tl.load(tail, mask=pmask, other=0.0), mask=pmask)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    rotated = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    block_h = min(next_pow2(H), 16)
    _rotary_kernel[(T, triton.cdiv(H, block_h))](
        x, out, positions, cos, sin, H, x.stride(0), x.stride(1),
        HALF=rotated // 2, D=D, BLOCK_H=block_h, BLOCK_HALF=next_pow2(rotated // 2),
        BLOCK_PASS=next_pow2(D - rotated),
    )
    return out


def apply_rotary_triton(
    x: torch.Tensor,  # [T, H, D]
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [P, R], R even and <= D
    sin: torch.Tensor,  # [P, R]
) -> torch.Tensor:  # [T, H, D]
    """Triton launcher: one program per (token, block of heads); math in float32."""
    return _rotate_triton(x, positions.contiguous(), cos.contiguous(), sin.contiguous())


def rotary_rows(
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, R]
    sin: torch.Tensor,  # [P, R]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, R] each
    """The table rows `apply_rotary_ref` multiplies by: cos at `positions`, and sin with
    its first half negated (rotate_half(y) * sin == roll(y, R/2) * that), in `dtype`.
    Every layer of a step rotates by the same rows: they can be gathered once."""
    half = cos.shape[-1] // 2
    c = cos[positions].to(dtype).unsqueeze(1)
    s = sin[positions].to(dtype).unsqueeze(1)
    s[..., :half].neg_()
    return c, s


def apply_rotary_ref(
    x: torch.Tensor,  # [T, H, D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, R], R even and <= D
    sin: torch.Tensor,  # [P, R]
    *,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # `rotary_rows` of the arguments
) -> torch.Tensor:  # [T, H, D]
    """Torch reference; float32 results equal HF `apply_rotary_pos_emb` exactly
    (-(a * b) and a * -b are the same float), partial rotary (R < D) included."""
    c, s = rows if rows is not None else rotary_rows(positions, cos, sin, x.dtype)
    rotated = c.shape[-1]
    if rotated == x.shape[-1]:
        return (x * c).add_(x.roll(rotated // 2, -1).mul_(s))  # two temporaries
    head = x[..., :rotated]
    return torch.cat(((head * c).add_(head.roll(rotated // 2, -1).mul_(s)), x[..., rotated:]), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # [T, H, D], last dim contiguous
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, R], R even and <= D
    sin: torch.Tensor,  # [P, R]
) -> torch.Tensor:  # [T, H, D]
    """Rotate the first R dims of every head of `x` by the table rows at `positions` (the
    rest copied); returns a new tensor (input untouched). The heads may be q's and k's
    side by side: one call rotates both."""
    if use_triton(x, positions, cos, sin):
        return apply_rotary_triton(x, positions, cos, sin)
    return apply_rotary_ref(x, positions, cos, sin)
