"""Gated activations over the concatenated [gate, up] projection: act(gate) * up, with act
SiLU (SwiGLU: the Llama and Qwen families) or tanh-approximated GELU (GeGLU: Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._dispatch import use_triton
from ._triton import tl, triton

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a global a compiled kernel may read


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [T, 2I] contiguous
    out_ptr,  # [T, I] contiguous
    inter,
    GELU: tl.constexpr,  # tanh-approximated GELU instead of SiLU
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        z = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))  # 0.5 x (1 + tanh z)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # round the activation to the input dtype first, as torch's activation then mul does
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul_triton(x: torch.Tensor, *, gelu: bool) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Triton launcher: grid (tokens, blocks of the intermediate dim)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()  # [T, 2I]
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)  # [T, I]
    if x2.shape[0] > 0 and inter > 0:
        block = 1024
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, GELU=gelu, BLOCK=block
        )
    return out.view(*x.shape[:-1], inter)


def act_and_mul_ref(x: torch.Tensor, *, gelu: bool) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """Torch reference: act(x[..., :I]) * x[..., I:] (gate first, up second), each op in
    x's dtype as transformers computes it."""
    inter = x.shape[-1] // 2
    gate = x[..., :inter]
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return act.mul_(x[..., inter:])


def act_and_mul(x: torch.Tensor, *, gelu: bool) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """act(gate) * up, with x = cat(gate, up) on the last dim: act is tanh-approximated GELU
    with `gelu`, else SiLU."""
    if use_triton(x):
        return act_and_mul_triton(x, gelu=gelu)
    return act_and_mul_ref(x, gelu=gelu)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """SwiGLU's torch reference: silu(gate) * up."""
    return act_and_mul_ref(x, gelu=False)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [..., 2I] -> [..., I]
    """SwiGLU: silu(gate) * up."""
    return act_and_mul(x, gelu=False)
