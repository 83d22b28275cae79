"""Sliding-window attention in the kernels: the torch references and the Triton kernels
(in the interpreter without CUDA) against a float64 definition built from a dense mask,
for windows from one position to more than any context, and none; and the window's
promise that positions no token sees are never read (they hold NaN here)."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)
from sprig.kernels.kv_quant import quantize_kv_ref
from sprig.kernels.paged import banded_attention_ref

# decode contexts: 1 and 0 slots, 8 and 37 (some windows equal them), 130 (two KV blocks)
DECODE_LENS = [1, 37, 0, 130, 8]
# extend: a prefill, one token after a prefix, 70 new tokens (two query blocks), a chunk
EXTEND_Q, EXTEND_PREFIX = [3, 1, 70, 9], [0, 12, 5, 40]
# 1; smaller than most contexts; equal to one (8, 37, 49 = 40 + 9); equal to the longest; larger; none
WINDOWS = [1, 3, 8, 37, 49, 130, 1000, None]


def _indptr(lengths: list[int]) -> torch.Tensor:  # [B+1] int32
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def make_case(
    q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
    storage: torch.dtype | None = None, seed: int = 0,
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """((q, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices), scales): contexts over
    distinct scattered slots of a random pool, quantized to `storage` when given (scales
    then hold the per token-head scales)."""
    g = torch.Generator().manual_seed(seed)
    pool = sum(kv_lens) + 9
    k = torch.randn(pool, hkv, d, generator=g) * 2
    v = torch.randn(pool, hkv, d, generator=g)
    scales: dict[str, torch.Tensor] = {}
    if storage is None:
        k, v = k.to(dtype), v.to(dtype)
    else:
        (k, scales["k_scale"]), (v, scales["v_scale"]) = quantize_kv_ref(k, storage), quantize_kv_ref(v, storage)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    slots = (torch.randperm(pool - 1, generator=g)[: sum(kv_lens)] + 1).to(torch.int32)
    return (q, k, v, _indptr(q_lens), _indptr(kv_lens), slots), scales


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    *, sm_scale: float, window: int | None = None, softcap: float | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    attend_until: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, Hq, D] float64
    """The definition: the token at context position p sees position j iff j <= p (with
    `attend_until` [T], iff j < its entry) and (no window, or j > p - window); its scores
    q.k * sm_scale in float64, capped to cap * tanh(s / cap) with a `softcap`, then a
    softmax over the whole context under that dense mask; with `sinks` [Hq], head h's row
    gains a column holding sinks[h] (not scaled, not capped) that the softmax runs over and
    that is dropped before the product with V. A token whose request has no context gets
    zeros."""
    k64 = k.double() if k_scale is None else k.double() * k_scale.double()[..., None]
    v64 = v.double() if v_scale is None else v.double() * v_scale.double()[..., None]
    hq = q.shape[1]
    group = hq // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        n, L = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if L == 0:
            continue
        pos = torch.arange(n)[:, None] + (L - n)  # [n, 1]
        j = torch.arange(L)[None, :]  # [1, L]
        mask = j <= pos if attend_until is None else j < attend_until[qo[b] : qo[b + 1], None].cpu()  # [n, L]
        if window is not None:
            mask &= j > pos - window
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        keys = k64[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v64[slots].repeat_interleave(group, dim=1)  # [L, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", q[qo[b] : qo[b + 1]].double(), keys) * sm_scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))  # [Hq, n, L]
        if sinks is not None:
            column = sinks.double().cpu()[:, None, None].expand(hq, n, 1)  # [Hq, n, 1]
            scores = torch.cat([scores, column], dim=-1)  # [Hq, n, L + 1]
        weights = scores.softmax(-1)[..., :L]  # a sink's column dropped
        out[qo[b] : qo[b + 1]] = torch.einsum("hnl,lhd->nhd", weights, values)
    return out


def poison_unseen(args: tuple[torch.Tensor, ...], scales: dict[str, torch.Tensor], window: int) -> int:
    """Set K/V (a quantized pool's scales) to NaN at every context slot that no new token
    of its request sees under `window`; returns how many were poisoned."""
    _, k, v, qo_indptr, kv_indptr, kv_indices = args
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    unseen = [
        kv_indices[kv[b] : kv[b] + max(0, (kv[b + 1] - kv[b]) - (qo[b + 1] - qo[b]) - window + 1)]
        for b in range(len(qo) - 1)
    ]
    slots = torch.cat(unseen).long()
    for t in list(scales.values()) if scales else [k, v]:
        t[slots] = float("nan")
    return slots.numel()


def decode_args(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Decode arguments (q, k, v, kv_indptr, kv_indices) of a case with one token each."""
    q, k, v, _, kv_indptr, kv_indices = args
    return q, k, v, kv_indptr, kv_indices


def on_device(device: str, args: tuple[torch.Tensor, ...], scales: dict[str, torch.Tensor]):
    return tuple(t.to(device) for t in args), {name: s.to(device) for name, s in scales.items()}


# ---------------------------------------------------------------- references vs the definition


@pytest.mark.parametrize(("window", "hq", "hkv", "storage"), [  # every pair of values
    (window, hq, hkv, [None, torch.int8][(i + j) % 2])
    for i, window in enumerate(WINDOWS) for j, (hq, hkv) in enumerate([(4, 4), (8, 2), (4, 1)])
])
def test_references_match_the_definition(window: int | None, hq: int, hkv: int, storage: torch.dtype | None) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 16, torch.float32, storage)
    got = decode_attention_ref(*decode_args(args), sm_scale=0.3, window=window, **scales)
    torch.testing.assert_close(got.double(), dense_attention(*args, sm_scale=0.3, window=window, **scales),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no context
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, scales = make_case(EXTEND_Q, kv_lens, hq, hkv, 16, torch.float32, storage, seed=1)
    got = extend_attention_ref(*args, sm_scale=0.3, window=window, **scales)
    torch.testing.assert_close(got.double(), dense_attention(*args, sm_scale=0.3, window=window, **scales),
                               atol=1e-5, rtol=1e-5)


def test_references_keep_the_full_path_where_the_window_does_not_bite() -> None:
    """A window no shorter than any context changes nothing, to the bit; a shorter one
    changes the result (the window is applied, not ignored)."""
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, _ = make_case(EXTEND_Q, kv_lens, 8, 2, 16, torch.float32)
    full = extend_attention_ref(*args, sm_scale=0.3)
    assert torch.equal(extend_attention_ref(*args, sm_scale=0.3, window=max(kv_lens)), full)
    assert not torch.allclose(extend_attention_ref(*args, sm_scale=0.3, window=max(kv_lens) - 1), full)
    args, _ = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 16, torch.float32)
    full = decode_attention_ref(*decode_args(args), sm_scale=0.3)
    assert torch.equal(decode_attention_ref(*decode_args(args), sm_scale=0.3, window=130), full)


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_references_read_only_what_the_window_shows(storage: torch.dtype | None) -> None:
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, scales = make_case(EXTEND_Q, kv_lens, 8, 2, 16, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.3, window=5, **scales)
    assert poison_unseen(args, scales, 5) > 0
    got = extend_attention_ref(*args, sm_scale=0.3, window=5, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 16, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.3, window=4, **scales)
    assert poison_unseen(args, scales, 4) > 0
    got = decode_attention_ref(*decode_args(args), sm_scale=0.3, window=4, **scales)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# long extends the banded path cuts into blocks: a 300-token prefill, 150 new after a prefix, one token
BANDED_Q, BANDED_PREFIX = [300, 150, 1], [0, 90, 400]


@pytest.mark.parametrize(("window", "storage"), [
    (1, None), (5, torch.int8), (64, None), (100, torch.int8), (299, None), (299, torch.int8),
])
def test_the_banded_reference_matches_the_definition(window: int, storage: torch.dtype | None) -> None:
    """The CPU backend's windowed extend, in blocks of queries each over what its window
    reaches: the definition (with a softcap and sinks too), never reading an unseen slot."""
    kv_lens = [a + b for a, b in zip(BANDED_Q, BANDED_PREFIX, strict=True)]
    args, scales = make_case(BANDED_Q, kv_lens, 8, 2, 16, torch.float32, storage, seed=3)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)) * 2
    for options in ({}, {"softcap": 5.0}, {"sinks": sinks}):
        want = dense_attention(*args, sm_scale=0.3, window=window, **scales, **options)
        plain = extend_attention_ref(*args, sm_scale=0.3, window=window, **scales, **options)
        poisoned = (tuple(a.clone() for a in args), {n: t.clone() for n, t in scales.items()})
        assert poison_unseen(*poisoned, window) > 0
        got = extend_attention_ref(*poisoned[0], sm_scale=0.3, window=window, **poisoned[1], **options, banded=True)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-6)


def test_the_banded_reference_takes_no_attend_until() -> None:
    args, _ = make_case([80], [80], 4, 2, 16, torch.float32)
    q, k, v, _, _, slots = args
    with pytest.raises(ValueError, match="attend_until"):
        banded_attention_ref(q, k, v, slots.long(), window=4, sm_scale=0.3, attend_until=torch.arange(1, 81))


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_holds_at_least_one_position(window: int, force_triton: None) -> None:
    args, _ = make_case([1, 1], [4, 2], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="at least one position"):
        decode_attention_ref(*decode_args(args), sm_scale=0.3, window=window)
    with pytest.raises(ValueError, match="at least one position"):
        decode_attention(*decode_args(args), sm_scale=0.3, window=window)
    with pytest.raises(ValueError, match="at least one position"):
        extend_attention_ref(*args, sm_scale=0.3, window=window)
    with pytest.raises(ValueError, match="at least one position"):
        extend_attention(*args, sm_scale=0.3, max_q_len=1, window=window)


# ---------------------------------------------------------------- Triton vs the definition

TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


@pytest.mark.parametrize(("window", "hq", "hkv", "splits"), [
    *((w, 8, 2, 1) for w in WINDOWS),
    *((w, 4, 1, 4) for w in WINDOWS),
    (3, 4, 4, 16),  # 16: empty splits, past the window's 3 positions in every context
])  # unwindowed, past the short contexts: test_softcap.py; with sinks: test_attention_sinks.py
def test_decode_triton_matches_the_definition(
    window: int | None, hq: int, hkv: int, splits: int, device: str, force_triton: None,
) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 64, torch.float32)
    want = dense_attention(*args, sm_scale=0.125, window=window)
    (q, k, v, _, kv_indptr, kv_indices), _ = on_device(device, args, scales)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=0.125, num_kv_splits=splits, out=out,
                           window=window)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4)])
def test_extend_triton_matches_the_definition(
    window: int | None, hq: int, hkv: int, device: str, force_triton: None,
) -> None:
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, scales = make_case(EXTEND_Q, kv_lens, hq, hkv, 64, torch.float32)
    want = dense_attention(*args, sm_scale=0.125, window=window)
    args, _ = on_device(device, args, scales)
    out = torch.full_like(args[0], float("nan"))
    got = extend_attention(*args, sm_scale=0.125, max_q_len=max(EXTEND_Q), out=out, window=window)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "storage", "window"), [
    (torch.float32, torch.int8, 5),
    (torch.bfloat16, torch.int8, 37),
    (torch.bfloat16, None, 2),
])
def test_triton_windows_in_16_bit_and_over_int8_pools(
    dtype: torch.dtype, storage: torch.dtype | None, window: int, device: str, force_triton: None,
) -> None:
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 64, dtype, storage)
    want = dense_attention(*args, sm_scale=0.125, window=window, **scales)
    (q, k, v, _, kv_indptr, kv_indices), dev_scales = on_device(device, args, scales)
    got = decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=0.125, num_kv_splits=3, window=window,
                           **dev_scales)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, scales = make_case(EXTEND_Q, kv_lens, 8, 2, 64, dtype, storage, seed=1)
    want = dense_attention(*args, sm_scale=0.125, window=window, **scales)
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.125, max_q_len=max(EXTEND_Q), window=window, **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, **tol)


@pytest.mark.parametrize("storage", [None, torch.int8])
def test_triton_reads_only_what_the_window_shows(storage: torch.dtype | None, device: str, force_triton: None) -> None:
    """Positions before every token's window hold NaN: a kernel that loaded one (even to
    mask it) would return NaN."""
    kv_lens = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
    args, scales = make_case(EXTEND_Q, kv_lens, 8, 2, 64, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.125, window=6, **scales)
    assert poison_unseen(args, scales, 6) > 0
    args, dev_scales = on_device(device, args, scales)
    got = extend_attention(*args, sm_scale=0.125, max_q_len=max(EXTEND_Q), window=6, **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 64, torch.float32, storage)
    want = dense_attention(*args, sm_scale=0.125, window=20, **scales)
    assert poison_unseen(args, scales, 20) > 0
    args, dev_scales = on_device(device, args, scales)
    got = decode_attention(*decode_args(args), sm_scale=0.125, num_kv_splits=4, window=20, **dev_scales)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- compiled, on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 100, 1024, 5000])
def test_gpu_long_contexts(window: int) -> None:
    args, _ = make_case([1] * 4, [4096, 1, 777, 2048], 32, 8, 128, torch.bfloat16)
    q, k, v, _, kv_indptr, kv_indices = (t.cuda() for t in args)
    got = decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=128**-0.5, num_kv_splits=16, window=window)
    want = decode_attention_ref(q, k, v, kv_indptr, kv_indices, sm_scale=128**-0.5, window=window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    args, _ = make_case([1000, 1, 333], [1000, 2001, 850], 32, 8, 128, torch.bfloat16)
    args = tuple(t.cuda() for t in args)
    got = extend_attention(*args, sm_scale=128**-0.5, max_q_len=1000, window=window)
    want = extend_attention_ref(*args, sm_scale=128**-0.5, window=window)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_windowed_decode_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed over contexts of other lengths written into the same
    buffers: the window needs no host work that capture would freeze."""
    args, _ = make_case([1] * 4, [300, 5, 1000, 64], 16, 4, 128, torch.float16)
    q, k, v, _, kv_indptr, kv_indices = (t.cuda() for t in args)
    indptr, indices = kv_indptr.clone(), torch.zeros(k.shape[0], dtype=torch.int32, device="cuda")
    indices[: kv_indices.numel()] = kv_indices
    out = torch.empty_like(q)

    def step() -> None:
        decode_attention(q, k, v, indptr, indices, sm_scale=128**-0.5, num_kv_splits=8, out=out, window=64)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(9)
    for lens in ([300, 5, 1000, 64], [201, 70, 900, 1], [3, 1200, 60, 65]):
        new = (torch.randperm(k.shape[0] - 1, generator=g)[: sum(lens)] + 1).to(torch.int32).cuda()
        indptr.copy_(_indptr(lens))
        indices[: new.numel()] = new
        graph.replay()
        want = decode_attention_ref(q, k, v, indptr, new, sm_scale=128**-0.5, window=64)
        torch.testing.assert_close(out, want, atol=4e-3, rtol=4e-3)
