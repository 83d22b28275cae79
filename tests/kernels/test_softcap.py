"""Attention-logit soft-capping in the kernels: the torch references, `attention_lse` and
the Triton kernels (in the interpreter without CUDA) against a float64 definition that
caps the scaled scores and then applies a dense mask, for caps that bite hard (1.0),
some (5.0), barely (50.0) and none, with and without a sliding window that bites."""

from __future__ import annotations

import math

import pytest
import torch
from test_sliding_window import decode_args, dense_attention, make_case, on_device, poison_unseen

from sprig.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)
from sprig.kernels import softcap as softcap_module
from sprig.kernels.attention_lse import attention_lse
from sprig.kernels.paged import request_attention_ref

# decode contexts: 1 and 0 slots, 8, 37, 130 (two KV blocks)
DECODE_LENS = [1, 37, 0, 130, 8]
# extend: a prefill, one token after a prefix, 70 new tokens (two query blocks), a chunk
EXTEND_Q, EXTEND_PREFIX = [3, 1, 70, 9], [0, 12, 5, 40]
EXTEND_KV = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
CAPS = [1.0, 5.0, 50.0, None]
WINDOWS = [None, 6]  # 6 bites every context but the shortest





# ---------------------------------------------------------------- references vs the definition


@pytest.mark.parametrize(("softcap", "window", "hq", "hkv", "storage"), [  # every pair of values
    (softcap, window, *[(4, 4), (8, 2)][(i + j) % 2], [None, torch.int8][(i // 2 + j) % 2])
    for i, softcap in enumerate(CAPS) for j, window in enumerate(WINDOWS)
])
def test_references_match_the_definition(
    softcap: float | None, window: int | None, hq: int, hkv: int, storage: torch.dtype | None,
) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 16, torch.float32, storage)
    got = decode_attention_ref(*decode_args(args), sm_scale=0.3, window=window, softcap=softcap, **scales)
    want = dense_attention(*args, sm_scale=0.3, softcap=softcap, window=window, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no context
    args, scales = make_case(EXTEND_Q, EXTEND_KV, hq, hkv, 16, torch.float32, storage, seed=1)
    got = extend_attention_ref(*args, sm_scale=0.3, window=window, softcap=softcap, **scales)
    want = dense_attention(*args, sm_scale=0.3, softcap=softcap, window=window, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_the_cap_is_applied_and_fades_as_it_grows() -> None:
    """A cap of 1 changes every output but the first prompt token's (it sees only itself);
    a cap far above every score changes nothing beyond rounding; the uncapped path is the
    SDPA one, to the bit."""
    args, _ = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 16, torch.float32)
    plain = extend_attention_ref(*args, sm_scale=0.3)
    assert torch.equal(extend_attention_ref(*args, sm_scale=0.3, softcap=None), plain)
    capped = extend_attention_ref(*args, sm_scale=0.3, softcap=1.0)
    assert bool(((capped - plain).abs().amax(dim=(1, 2))[1:] > 1e-3).all())
    torch.testing.assert_close(extend_attention_ref(*args, sm_scale=0.3, softcap=1e6), plain, atol=1e-5, rtol=1e-5)


def test_long_prompts_are_capped_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a score budget smaller than one row, rows go one by one: the result is the same."""
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 16, torch.float32, torch.int8, seed=2)
    want = dense_attention(*args, sm_scale=0.3, softcap=2.0, window=9, **scales)
    monkeypatch.setattr(softcap_module, "CAPPED_SCORE_ELEMENTS", 100)
    got = extend_attention_ref(*args, sm_scale=0.3, window=9, softcap=2.0, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_capped_references_read_only_what_the_window_shows() -> None:
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 16, torch.float32)
    want = dense_attention(*args, sm_scale=0.3, softcap=3.0, window=5)
    assert poison_unseen(args, scales, 5) > 0
    got = extend_attention_ref(*args, sm_scale=0.3, window=5, softcap=3.0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, -2.0, math.nan, math.inf])
def test_a_softcap_is_a_finite_positive_number(softcap: float, force_triton: None) -> None:
    args, _ = make_case([1, 1], [4, 2], 4, 2, 16, torch.float32)
    q, k, v, _, _, kv_indices = args
    calls = [
        lambda: request_attention_ref(q[:1], k, v, kv_indices[:4].long(), sm_scale=0.3, softcap=softcap),
        lambda: decode_attention_ref(*decode_args(args), sm_scale=0.3, softcap=softcap),
        lambda: decode_attention(*decode_args(args), sm_scale=0.3, softcap=softcap),
        lambda: extend_attention_ref(*args, sm_scale=0.3, softcap=softcap),
        lambda: extend_attention(*args, sm_scale=0.3, max_q_len=1, softcap=softcap),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="softcap is a finite number > 0"):
            call()


@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("masked", [False, True])
def test_attention_lse_caps_before_the_mask(softcap: float | None, masked: bool) -> None:
    """The fused CPU kernel (uncapped) and the explicit path (capped) against the
    definition, the log-sum-exp included: masked scores weigh nothing even capped."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 5 if i == 0 else 11, 16, generator=g) * (3 if i < 2 else 1) for i in range(3))
    valid = torch.rand(2, 1, 5, 11, generator=g) > 0.4 if masked else None
    if valid is not None:
        valid[..., 0] = True
    o, lse = attention_lse(q, k, v, scale=0.25, valid=valid, softcap=softcap)
    scores = torch.matmul(q.double(), k.double().transpose(-1, -2)) * 0.25
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o.double(), scores.softmax(-1) @ v.double(), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Triton vs the definition


@pytest.mark.parametrize(("softcap", "window", "hq", "hkv", "splits"), [  # every pair of values
    *((cap, w, *[(8, 2, 1), (4, 1, 4)][(i + j) % 2]) for i, cap in enumerate(CAPS) for j, w in enumerate(WINDOWS)),
    (1.0, None, 4, 4, 16),  # 16: empty splits past the short contexts
])
def test_decode_triton_matches_the_definition(
    softcap: float | None, window: int | None, hq: int, hkv: int, splits: int, device: str, force_triton: None,
) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 64, torch.float32)
    want = dense_attention(*args, sm_scale=0.25, softcap=softcap, window=window)
    (q, k, v, _, kv_indptr, kv_indices), _ = on_device(device, args, scales)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=0.25, num_kv_splits=splits, out=out,
                           window=window, softcap=softcap)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("softcap", "window", "hq", "hkv"), [  # every pair of values
    (cap, w, *[(8, 2), (4, 4)][(i + j) % 2]) for i, cap in enumerate(CAPS) for j, w in enumerate(WINDOWS)
])
def test_extend_triton_matches_the_definition(
    softcap: float | None, window: int | None, hq: int, hkv: int, device: str, force_triton: None,
) -> None:
    args, scales = make_case(EXTEND_Q, EXTEND_KV, hq, hkv, 64, torch.float32)
    want = dense_attention(*args, sm_scale=0.25, softcap=softcap, window=window)
    args, _ = on_device(device, args, scales)
    out = torch.full_like(args[0], float("nan"))
    got = extend_attention(*args, sm_scale=0.25, max_q_len=max(EXTEND_Q), out=out, window=window, softcap=softcap)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "storage", "window", "softcap"), [
    (torch.float32, torch.int8, 5, 1.0),
    (torch.bfloat16, None, 37, 50.0),
])  # with sinks too, over int8 pools in bfloat16 and with caps 5.0 and 2.0: test_attention_sinks.py
def test_triton_caps_in_16_bit_and_over_int8_pools(
    dtype: torch.dtype, storage: torch.dtype | None, window: int | None, softcap: float,
    device: str, force_triton: None, tol: dict[torch.dtype, dict[str, float]],
) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 64, dtype, storage)
    want = dense_attention(*args, sm_scale=0.25, softcap=softcap, window=window, **scales)
    (q, k, v, _, kv_indptr, kv_indices), dev_scales = on_device(device, args, scales)
    got = decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=0.25, num_kv_splits=3, window=window,
                           softcap=softcap, **dev_scales)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, **tol[dtype])
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 64, dtype, storage, seed=1)
    want = dense_attention(*args, sm_scale=0.25, softcap=softcap, window=window, **scales)
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.25, max_q_len=max(EXTEND_Q), window=window, softcap=softcap,
                           **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, **tol[dtype])


def test_capped_triton_reads_only_what_the_window_shows(device: str, force_triton: None) -> None:
    """Positions before every token's window hold NaN: capping a loaded one, masked or
    not, would spread it."""
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 64, torch.float32, torch.int8)
    want = dense_attention(*args, sm_scale=0.25, softcap=2.0, window=6, **scales)
    assert poison_unseen(args, scales, 6) > 0
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.25, max_q_len=max(EXTEND_Q), window=6, softcap=2.0, **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- compiled, on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("window", "softcap"), [(None, 50.0), (100, 50.0), (None, 1.0)])
def test_gpu_long_contexts(window: int | None, softcap: float) -> None:
    args, _ = make_case([1] * 4, [4096, 1, 777, 2048], 32, 8, 128, torch.bfloat16)
    q, k, v, _, kv_indptr, kv_indices = (t.cuda() for t in args)
    kw = {"sm_scale": 128**-0.5, "window": window, "softcap": softcap}
    got = decode_attention(q, k, v, kv_indptr, kv_indices, num_kv_splits=16, **kw)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, kv_indptr, kv_indices, **kw), atol=2e-2, rtol=2e-2)
    args, _ = make_case([1000, 1, 333], [1000, 2001, 850], 32, 8, 128, torch.bfloat16)
    args = tuple(t.cuda() for t in args)
    got = extend_attention(*args, max_q_len=1000, **kw)
    torch.testing.assert_close(got, extend_attention_ref(*args, **kw), atol=2e-2, rtol=2e-2)
