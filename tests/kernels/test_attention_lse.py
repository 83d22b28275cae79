"""`attention_lse` (the fused flash kernel on the CPU) and its explicit product (the path
off the CPU) against float64 softmax and logsumexp, with masks and strided K/V."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels.attention_lse import attention_lse, explicit_attention_lse


def explicit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`explicit_attention_lse` behind `attention_lse`'s signature."""
    bias = None if valid is None else torch.where(valid, 0.0, float("-inf"))
    return explicit_attention_lse(q.float(), k.float(), v.float(), scale=scale, bias=bias)


PATHS = {"flash": attention_lse, "explicit": explicit}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 5, 24])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_float64_softmax_and_logsumexp(path: str, rows: int, masked: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows + 10 * masked)
    N, H, L, D = 3, 2, 37, 16
    q = torch.randn(N, H, rows, D, generator=g).to(dtype)
    k = torch.randn(N, L, H, D, generator=g).to(dtype).transpose(1, 2)  # token-major, strided
    v = torch.randn(N, L, H, D, generator=g).to(dtype).transpose(1, 2)
    valid = None
    if masked:
        lens = torch.tensor([37, 5, 20])
        valid = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]  # [N, 1, 1, L]
    out, lse = PATHS[path](q, k, v, scale=0.3, valid=valid)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (N, H, rows, D) and lse.shape == (N, H, rows)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.3
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [2, 5])
def test_scores_far_below_the_peak_and_masked_keys_weigh_nothing_visible(path: str, rows: int) -> None:
    """Scores hundreds below their row's peak (a sharp head) and masked keys whose V is
    large: the result still equals float64."""
    g = torch.Generator().manual_seed(7)
    N, H, L, D = 2, 3, 40, 8
    q = torch.randn(N, H, rows, D, generator=g) * 30
    k = torch.randn(N, H, L, D, generator=g) * 30
    v = torch.randn(N, H, L, D, generator=g)
    valid = (torch.arange(L)[None, :] < torch.tensor([40, 23])[:, None])[:, None, None, :]
    v = v.masked_fill(~valid[:, :, 0, :, None], 1e4)  # what padding must never leak
    out, lse = PATHS[path](q, k, v, scale=1.0, valid=valid)
    scores = (q.double() @ k.double().transpose(-1, -2)).masked_fill(~valid, float("-inf"))
    assert (scores.amax(-1, keepdim=True) - scores).nan_to_num(posinf=0).amax() > 500  # far below
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.double(), scores.softmax(-1) @ v.double(), atol=1e-5, rtol=1e-5)
