"""Gated activations, store_kv and the token bitmask: references vs ground truth, Triton vs
reference."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels import (
    act_and_mul,
    act_and_mul_ref,
    apply_token_bitmask,
    apply_token_bitmask_ref,
    silu_and_mul,
    silu_and_mul_ref,
    store_kv,
    store_kv_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_silu_and_mul_ref_is_gate_first() -> None:
    torch.manual_seed(0)
    gate, up = torch.randn(2, 5, 24, dtype=torch.float64)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(torch.cat([gate, up], -1)), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 300), (2, 3, 2 * 64), (0, 32)])
def test_silu_and_mul_triton(
    dtype: torch.dtype, shape: tuple[int, ...], device: str, force_triton: None, tol: dict
) -> None:
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype) * 3
    got = silu_and_mul(x.to(device))
    expected = silu_and_mul_ref(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_ref_matches_gemma(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    torch.manual_seed(3)
    gate, up = torch.randn(2, 5, 24, dtype=dtype) * 3
    expected = ACT2FN["gelu_pytorch_tanh"](gate) * up  # transformers' Gemma MLP
    got = act_and_mul_ref(torch.cat([gate, up], -1), gelu=True)
    torch.testing.assert_close(got, expected)  # float32: a strided gate rounds some rows 1 ulp apart
    assert not torch.equal(got, act_and_mul_ref(torch.cat([gate, up], -1), gelu=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 300), (2, 3, 2 * 64), (0, 32)])
def test_gelu_tanh_and_mul_triton(
    dtype: torch.dtype, shape: tuple[int, ...], device: str, force_triton: None, tol: dict
) -> None:
    torch.manual_seed(4)
    x = torch.randn(shape, dtype=dtype) * 4  # tanh's saturated tails included
    got = act_and_mul(x.to(device), gelu=True)
    expected = act_and_mul_ref(x, gelu=True)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


def _store_case(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(2)
    k_buf = torch.randn(40, 2, 80, dtype=dtype)
    v_buf = torch.randn(40, 2, 80, dtype=dtype)
    loc = torch.tensor([5, 1, 39, 17, 6], dtype=torch.int32)
    k = torch.randn(5, 2, 80, dtype=dtype)
    v = torch.randn(5, 2, 80, dtype=dtype)
    return k_buf, v_buf, loc, k, v


def test_store_kv_ref_writes_only_loc() -> None:
    k_buf, v_buf, loc, k, v = _store_case(torch.float32)
    k0, v0 = k_buf.clone(), v_buf.clone()
    store_kv_ref(k_buf, v_buf, loc, k, v)
    for i, slot in enumerate(loc.tolist()):
        assert torch.equal(k_buf[slot], k[i]) and torch.equal(v_buf[slot], v[i])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[loc.long()] = False
    assert torch.equal(k_buf[untouched], k0[untouched])
    assert torch.equal(v_buf[untouched], v0[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_triton(dtype: torch.dtype, device: str, force_triton: None) -> None:
    k_buf, v_buf, loc, k, v = _store_case(dtype)
    ek, ev = k_buf.clone(), v_buf.clone()
    store_kv_ref(ek, ev, loc, k, v)
    gk, gv = k_buf.to(device), v_buf.to(device)
    # k from a fused projection (non-contiguous rows), v contiguous
    kv = torch.cat([k, v], dim=1).to(device)  # [n, 4, D]
    store_kv(gk, gv, loc.to(device), kv[:, :2], v.to(device))
    assert torch.equal(gk.cpu(), ek) and torch.equal(gv.cpu(), ev)
    store_kv(gk, gv, loc[:0].to(device), k[:0].to(device), v[:0].to(device))  # n = 0
    assert torch.equal(gk.cpu(), ek)


def _naive_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                   rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    targets = rows if rows is not None else list(range(logits.shape[0]))
    for i, row in enumerate(targets):
        for tok in range(vocab):
            word = int(bitmask[i, tok // 32]) & 0xFFFFFFFF
            if not (word >> (tok % 32)) & 1:
                out[row, tok] = float("-inf")
    return out


def _bitmask_case(rows: int, vocab: int, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(3)
    logits = torch.randn(6, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
    bitmask[0, 0] = -1  # all of the first 32 allowed
    bitmask[0, 1] = 0  # none of the next 32
    return logits, bitmask


@pytest.mark.parametrize("use_rows", [False, True])
def test_bitmask_ref_matches_naive(use_rows: bool) -> None:
    rows = [4, 0, 2] if use_rows else None
    logits, bitmask = _bitmask_case(3 if use_rows else 6, 77, 4)  # 4 words > ceil(77/32)
    expected = _naive_bitmask(logits, bitmask, rows)
    apply_token_bitmask_ref(logits, bitmask, rows=torch.tensor(rows) if use_rows else None)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[rows[0] if use_rows else 0, 32:64]).all()
    assert torch.isfinite(logits[rows[0] if use_rows else 0, :32]).all()
    if use_rows:  # unconstrained rows stay untouched
        assert torch.isfinite(logits[[1, 3, 5]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("use_rows", "vocab"), [(False, 77), (True, 77), (False, 2100)])
def test_bitmask_triton(
    dtype: torch.dtype, use_rows: bool, vocab: int, device: str, force_triton: None
) -> None:
    rows = torch.tensor([5, 1], dtype=torch.int32) if use_rows else None
    logits, bitmask = _bitmask_case(2 if use_rows else 6, vocab, (vocab + 31) // 32 + 1)
    logits = logits.to(dtype)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, rows=rows)
    got = logits.to(device)
    apply_token_bitmask(got, bitmask.to(device), rows=None if rows is None else rows.to(device))
    assert torch.equal(got.cpu(), expected)
    assert torch.isinf(expected).any() and torch.isfinite(expected).any()
