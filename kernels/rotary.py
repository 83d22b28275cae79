"""Rotary position embeddings, neox / Hugging Face `rotate_half` style.

`rope_cos_sin` builds the HF cos/sin tables ([P, D], frequencies concatenated twice);
`apply_rotary` rotates heads (q's, k's, or both side by side) by the table rows at `positions`:
    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._dispatch import next_pow2, use_triton
from ._triton import tl, triton


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None, max_positions: int,
              device: torch.device | str | None) -> torch.Tensor:  # [D/2] float32
    """Inverse frequencies with exactly HF transformers' float32 math per rope type."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    inv_freq = 1.0 / (base ** (exponent / head_dim))
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
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
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    *,
    base: float,
    scaling: dict[str, Any] | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_positions, head_dim]
    """HF cos/sin tables for positions 0..max_positions-1 (computed in float32, then cast)."""
    inv_freq = _inv_freq(head_dim, base, scaling, max_positions, device)  # [D/2]
    positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, H, D], last dim contiguous
    out_ptr,  # [T, H, D] contiguous
    pos_ptr,  # [T] int64
    cos_ptr,  # [P, D] contiguous
    sin_ptr,  # [P, D] contiguous
    H,
    stride_xt,
    stride_xh,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
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
    obase = out_ptr + t * H * (2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(obase, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(obase + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    block_h = min(next_pow2(H), 16)
    _rotary_kernel[(T, triton.cdiv(H, block_h))](
        x, out, positions, cos, sin, H, x.stride(0), x.stride(1),
        HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=next_pow2(D // 2),
    )
    return out


def apply_rotary_triton(
    x: torch.Tensor,  # [T, H, D]
    positions: torch.Tensor,  # [T] int
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
) -> torch.Tensor:  # [T, H, D]
    """Triton launcher: one program per (token, block of heads); math in float32."""
    return _rotate_triton(x, positions.contiguous(), cos.contiguous(), sin.contiguous())


def rotary_rows(
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 1, D] each
    """The table rows `apply_rotary_ref` multiplies by: cos at `positions`, and sin with
    its first half negated (rotate_half(x) * sin == roll(x, D/2) * that), in `dtype`.
    Every layer of a step rotates by the same rows: they can be gathered once."""
    half = cos.shape[-1] // 2
    c = cos[positions].to(dtype).unsqueeze(1)
    s = sin[positions].to(dtype).unsqueeze(1)
    s[..., :half].neg_()
    return c, s


def apply_rotary_ref(
    x: torch.Tensor,  # [T, H, D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
    *,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # `rotary_rows` of the arguments
) -> torch.Tensor:  # [T, H, D]
    """Torch reference; float32 results equal HF `apply_rotary_pos_emb` exactly
    (-(a * b) and a * -b are the same float)."""
    c, s = rows if rows is not None else rotary_rows(positions, cos, sin, x.dtype)
    return (x * c).add_(x.roll(x.shape[-1] // 2, -1).mul_(s))  # two temporaries


def apply_rotary(
    x: torch.Tensor,  # [T, H, D], last dim contiguous
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
) -> torch.Tensor:  # [T, H, D]
    """Rotate every head of `x` by the table rows at `positions`; returns a new tensor
    (input untouched). The heads may be q's and k's side by side: one call rotates both."""
    if use_triton(x, positions, cos, sin):
        return apply_rotary_triton(x, positions, cos, sin)
    return apply_rotary_ref(x, positions, cos, sin)
