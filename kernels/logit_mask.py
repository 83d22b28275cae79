"""Grammar bitmask on logits: disallowed tokens become -inf, in place.

Bitmask layout (xgrammar's): int32 words [R, W], W >= ceil(V/32); bit j of word w
(little-endian within the word) set means token 32*w + j is allowed. Bits past V are
ignored. Bitmask row i applies to logits row `rows[i]` (or row i when `rows` is None).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton
from ._triton import tl, triton


@triton.jit
def _bitmask_kernel(
    logits_ptr,  # [B, V]
    mask_ptr,  # [R, W] int32
    rows_ptr,  # [R] int (read when HAS_ROWS)
    V,
    stride_logits,
    stride_mask,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # tokens per program, a multiple of 32
):
    r = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    row = r
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    words = tl.load(mask_ptr + r * stride_mask + tok // 32, mask=tok < V, other=-1)
    allowed = ((words >> (tok % 32)) & 1) != 0
    ptrs = logits_ptr + row * stride_logits + tok
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=(tok < V) & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor,  # [B, V]
    bitmask: torch.Tensor,  # [R, W] int32
    *,
    rows: torch.Tensor | None = None,  # [R] int
) -> None:
    """Triton launcher: grid (bitmask rows, blocks of tokens); logits' last dim contiguous."""
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    V = logits.shape[1]
    R = rows.shape[0] if rows is not None else logits.shape[0]
    if R == 0 or V == 0:
        return
    block = 1024
    _bitmask_kernel[(R, triton.cdiv(V, block))](
        logits, bitmask, rows if rows is not None else bitmask, V,
        logits.stride(0), bitmask.stride(0), HAS_ROWS=rows is not None, BLOCK=block,
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words -> [R, V] bool (True = allowed)."""
    words = bitmask[:, : (vocab_size + 31) // 32]  # [R, W']
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [R, W', 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_ref(
    logits: torch.Tensor,  # [B, V]
    bitmask: torch.Tensor,  # [R, W] int32
    *,
    rows: torch.Tensor | None = None,  # [R] int
) -> None:
    """Torch reference, in place."""
    V = logits.shape[1]
    if rows is None:
        allowed = unpack_bitmask(bitmask[: logits.shape[0]], V)  # [B, V]
        logits.masked_fill_(~allowed, float("-inf"))
        return
    allowed = unpack_bitmask(bitmask[: rows.shape[0]], V)  # [R, V]
    sub = logits[rows].masked_fill_(~allowed, float("-inf"))  # [R, V]
    logits[rows] = sub


def apply_token_bitmask(
    logits: torch.Tensor,  # [B, V]
    bitmask: torch.Tensor,  # [R, W] int32
    *,
    rows: torch.Tensor | None = None,  # [R] int
) -> None:
    """Set logits of tokens the bitmask disallows to -inf, in place (see module docstring)."""
    if use_triton(logits, bitmask, rows):
        apply_token_bitmask_triton(logits, bitmask, rows=rows)
    else:
        apply_token_bitmask_ref(logits, bitmask, rows=rows)
