"""`attention_lse` on both of its CPU paths (the fused flash kernel, the explicit product)
against float64 softmax and logsumexp, with masks and strided K/V."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels.attention_lse import FLASH_MIN_ROWS, attention_lse


@pytest.mark.parametrize("rows", [1, 2, FLASH_MIN_ROWS, 24])  # both sides of the path choice
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_float64_softmax_and_logsumexp(rows: int, masked: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows + 10 * masked)
    N, H, L, D = 3, 2, 37, 16
    q = torch.randn(N, H, rows, D, generator=g).to(dtype)
    k = torch.randn(N, L, H, D, generator=g).to(dtype).transpose(1, 2)  # token-major, strided
    v = torch.randn(N, L, H, D, generator=g).to(dtype).transpose(1, 2)
    valid = None
    if masked:
        lens = torch.tensor([37, 5, 20])
        valid = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]  # [N, 1, 1, L]
    out, lse = attention_lse(q, k, v, scale=0.3, valid=valid)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (N, H, rows, D) and lse.shape == (N, H, rows)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.3
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.double(), atol=1e-5, rtol=1e-5)
