"""SwiGLU activation: silu(gate) * up over the concatenated [gate, up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import use_triton
from ._triton import tl, triton


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I] contiguous
    out_ptr,  # [T, I] contiguous
    inter,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate))
    # round the activation to the input dtype first, as torch's silu then mul does
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton launcher: grid (tokens, blocks of the intermediate dim)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()  # [T, 2I]
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)  # [T, I]
    if x2.shape[0] > 0 and inter > 0:
        block = 1024
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Torch reference: silu(x[..., :I]) * x[..., I:] (gate first, up second)."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]).mul_(x[..., inter:])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """silu(gate) * up, with x = cat(gate, up) on the last dim."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
