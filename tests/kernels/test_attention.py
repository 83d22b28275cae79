"""Decode and extend attention: references vs a naive per-token loop, Triton vs references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)


def _indptr(lengths: list[int]) -> torch.Tensor:  # [B+1] int32
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _pool(slots: int, hkv: int, d: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(slots, hkv, d, generator=g).to(dtype)
    return k, v


def _slots(total: int, pool: int, seed: int) -> torch.Tensor:  # [total] int32, distinct, > 0
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(pool - 1, generator=g)[:total] + 1).to(torch.int32)


def _naive_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [D], keys/values [L, D] -> [D], a plain float64 softmax; zeros when L == 0."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    scores = [float(q @ keys[j]) * scale for j in range(keys.shape[0])]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return sum(w * values[j] for j, w in enumerate(weights)) / total


def _naive_extend(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scale):
    q64, k64, v64 = q.double(), k_buf.double(), v_buf.double()
    out = torch.zeros_like(q64)
    group = q.shape[1] // k_buf.shape[1]
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        prefix = (k1 - k0) - (q1 - q0)
        for i in range(q1 - q0):
            visible = kv_indices[k0 : k0 + prefix + i + 1].long()
            for h in range(q.shape[1]):
                out[q0 + i, h] = _naive_attend(q64[q0 + i, h], k64[visible, h // group],
                                               v64[visible, h // group], scale)
    return out


def _extend_case(q_lens, prefix_lens, hq, hkv, d, dtype, seed=0):
    kv_lens = [a + b for a, b in zip(q_lens, prefix_lens, strict=True)]
    pool = sum(kv_lens) + 7
    k_buf, v_buf = _pool(pool, hkv, d, dtype, seed)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(seed + 1))
    return (q.to(dtype), k_buf, v_buf, _indptr(q_lens), _indptr(kv_lens),
            _slots(sum(kv_lens), pool, seed))


def _decode_case(lens, hq, hkv, d, dtype, seed=0):
    pool = sum(lens) + 5
    k_buf, v_buf = _pool(pool, hkv, d, dtype, seed)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype), k_buf, v_buf, _indptr(lens), _slots(sum(lens), pool, seed)


# ---------------------------------------------------------------- references vs naive


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 1), (8, 1), (6, 6), (16, 8), (12, 12), (24, 12)])
@pytest.mark.parametrize("lens", [[5, 0, 1, 23], [21, 19, 0, 22], [3, 40, 17, 9, 30, 1], [13, 17, 12, 16]])  # mixed lengths; the last: one padded bucket
def test_decode_ref_matches_naive(hq: int, hkv: int, lens: list[int]) -> None:
    q, k_buf, v_buf, indptr, indices = _decode_case(lens, hq, hkv, 16, torch.float32)
    got = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=0.3)
    # decode is extend with one new token whose context is all of kv (q_len 1, prefix L-1)
    expected = torch.zeros(len(lens), hq, 16, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n:
            expected[b] = _naive_extend(q[b : b + 1], k_buf, v_buf, _indptr([1]), _indptr([n]),
                                        indices[indptr[b] : indptr[b + 1]], 0.3)[0]
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    for b in (b for b, n in enumerate(lens) if n == 0):
        assert torch.equal(got[b], torch.zeros_like(got[b]))


@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 1), (8, 1)])
def test_extend_ref_matches_naive(hq: int, hkv: int) -> None:
    q_lens, prefixes = [3, 1, 6, 2], [0, 4, 5, 0]
    case = _extend_case(q_lens, prefixes, hq, hkv, 16, torch.float32)
    got = extend_attention_ref(*case, sm_scale=0.25)
    expected = _naive_extend(*case, 0.25)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    q_lens=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    prefix_seed=st.integers(0, 2**16),
    group=st.sampled_from([1, 2, 4]),
)
def test_extend_ref_property(q_lens: list[int], prefix_seed: int, group: int) -> None:
    g = torch.Generator().manual_seed(prefix_seed)
    prefixes = torch.randint(0, 7, (len(q_lens),), generator=g).tolist()
    case = _extend_case(q_lens, prefixes, 2 * group, 2, 8, torch.float32, seed=prefix_seed)
    got = extend_attention_ref(*case, sm_scale=0.5)
    torch.testing.assert_close(got.double(), _naive_extend(*case, 0.5), atol=1e-5, rtol=1e-5)


def test_extend_ref_rejects_short_context() -> None:
    case = _extend_case([4], [0], 2, 2, 8, torch.float32)
    q, k_buf, v_buf, qo, _, indices = case
    with pytest.raises(ValueError, match="kv_len"):
        extend_attention_ref(q, k_buf, v_buf, qo, _indptr([3]), indices, sm_scale=1.0)


# ---------------------------------------------------------------- Triton vs references

DECODE_CASES = [
    # hq, hkv, d, dtype, lens, splits
    (4, 4, 64, torch.float32, [1, 37, 0, 130], 4),
    (8, 2, 128, torch.float16, [65, 3], 8),
    (8, 1, 80, torch.float32, [19, 100], 3),
    (16, 2, 64, torch.bfloat16, [50, 7, 1], 2),
    (8, 8, 96, torch.float16, [33], 1),
    (8, 4, 64, torch.float32, [40, 0, 2], None),  # the kernel's own split choice
    (4, 1, 256, torch.float32, [70, 2], 16),  # more splits than some contexts
]


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "lens", "splits"), DECODE_CASES)
def test_decode_triton_matches_ref(
    hq: int, hkv: int, d: int, dtype: torch.dtype, lens: list[int], splits: int | None,
    device: str, force_triton: None, tol: dict,
) -> None:
    q, k_buf, v_buf, indptr, indices = _decode_case(lens, hq, hkv, d, dtype)
    scale = d**-0.5
    expected = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=scale)
    got = decode_attention(
        *(t.to(device) for t in (q, k_buf, v_buf, indptr, indices)),
        sm_scale=scale, num_kv_splits=splits,
    )
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b].cpu(), torch.zeros_like(got[b].cpu()))


def test_decode_triton_writes_into_out(device: str, force_triton: None, tol: dict) -> None:
    q, k_buf, v_buf, indptr, indices = _decode_case([9, 4], 4, 2, 64, torch.float32)
    out = torch.full_like(q, float("nan")).to(device)
    got = decode_attention(*(t.to(device) for t in (q, k_buf, v_buf, indptr, indices)),
                           sm_scale=0.125, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = decode_attention_ref(q, k_buf, v_buf, indptr, indices, sm_scale=0.125)
    torch.testing.assert_close(out.cpu(), expected, **tol[torch.float32])


EXTEND_CASES = [
    # hq, hkv, d, dtype, q_lens, prefix_lens
    (4, 4, 64, torch.float32, [1, 5, 70, 3], [0, 9, 3, 100]),  # q_len 70 spans two blocks
    (8, 2, 128, torch.float16, [17, 1], [0, 40]),
    (8, 1, 64, torch.bfloat16, [6, 11], [13, 0]),
    (4, 1, 80, torch.float32, [9], [0]),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "q_lens", "prefixes"), EXTEND_CASES)
def test_extend_triton_matches_ref(
    hq: int, hkv: int, d: int, dtype: torch.dtype, q_lens: list[int], prefixes: list[int],
    device: str, force_triton: None, tol: dict,
) -> None:
    case = _extend_case(q_lens, prefixes, hq, hkv, d, dtype)
    scale = d**-0.5
    expected = extend_attention_ref(*case, sm_scale=scale)
    out = torch.full_like(case[0], float("nan")).to(device)
    got = extend_attention(*(t.to(device) for t in case), sm_scale=scale,
                           max_q_len=max(q_lens), out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


def test_references_follow_the_dispatcher_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPRIG_FORCE_TRITON", raising=False)
    case = _extend_case([3, 2], [1, 0], 4, 2, 64, torch.float32)
    got = extend_attention(*case, sm_scale=0.1, max_q_len=3)
    assert torch.equal(got, extend_attention_ref(*case, sm_scale=0.1))


# ---------------------------------------------------------------- compiled, on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_long_contexts(dtype: torch.dtype) -> None:
    lens = [4096, 1, 777, 2048]
    q, k_buf, v_buf, indptr, indices = _decode_case(lens, 32, 8, 128, dtype)
    args = [t.cuda() for t in (q, k_buf, v_buf, indptr, indices)]
    got = decode_attention(*args, sm_scale=128**-0.5, num_kv_splits=16)
    expected = decode_attention_ref(*args, sm_scale=128**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    case = [t.cuda() for t in _extend_case([1000, 1, 333], [0, 2000, 517], 32, 8, 128, dtype)]
    got = extend_attention(*case, sm_scale=128**-0.5, max_q_len=1000)
    expected = extend_attention_ref(*case, sm_scale=128**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
