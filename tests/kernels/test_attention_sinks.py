"""Attention sinks (gpt-oss: one learned logit per query head that joins every softmax's
denominator and weighs no value) in the kernels: the torch references and the Triton
kernels (in the interpreter without CUDA) against a float64 definition written out here
(scores, dense mask, one more column holding the head's sink, softmax, that column
dropped). Extend with and without a cached prefix, decode with split-K (empty splits
included), sliding windows, soft caps, image blocks (`attend_until`), GQA, int8 pools,
bf16; sinks that swallow almost all the mass (+20), that take none (-20), mixed per
head; and sinks=None, which leaves every path as it was."""

from __future__ import annotations

import pytest
import torch
from test_image_blocks import image_case
from test_sliding_window import (
    DECODE_LENS,
    EXTEND_PREFIX,
    EXTEND_Q,
    decode_args,
    dense_attention,
    make_case,
    on_device,
    poison_unseen,
)

from sprig.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)
from sprig.kernels.attention_lse import add_sinks_, attention_lse
from sprig.kernels.decode_attention import decode_attention_triton
from sprig.kernels.extend_attention import extend_attention_triton
from sprig.kernels.paged import request_attention_ref

EXTEND_KV = [a + b for a, b in zip(EXTEND_Q, EXTEND_PREFIX, strict=True)]
# per head, cycled: most of the mass to the sink; none; a little; about half (the
# scores' log-sum-exp is near 8 here)
MIXED = [20.0, -20.0, 0.5, 8.0]
SINKS = ["mixed", "high", "low"]
# (kind, window, softcap) of the Triton cases, "low" left out (it changes nothing beyond
# rounding: see test_sinks_none_is_the_path_without_sinks): each feature beside the sinks off
# and on, and the two together; the head layouts alternate, so that each kind meets each
TRITON_CASES = [("mixed", None, None), ("high", 6, None), ("high", None, 2.0), ("mixed", 6, 5.0)]


def make_sinks(kind: str, hq: int, device: str | torch.device = "cpu") -> torch.Tensor:  # [hq] float32
    values = {"mixed": MIXED, "high": [20.0], "low": [-20.0]}[kind]
    return torch.tensor([values[h % len(values)] for h in range(hq)], dtype=torch.float32, device=device)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float) -> None:
    """Each (token, head) row against the definition relative to the row's own size (a
    +20 sink shrinks a row to about e^-12, far below any absolute tolerance), or to the
    smallest normal number of `got`'s dtype where that is larger (float16 holds smaller
    values only coarsely)."""
    size = want.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(got.dtype).tiny)
    torch.testing.assert_close(got.cpu().double() / size, want / size, atol=atol, rtol=rtol)


def triton_extend(args, scales, device: str, **kw) -> torch.Tensor:
    """`extend_attention` (forced to Triton) on `device`, writing into a NaN-filled `out`."""
    args, dev_scales = on_device(device, args, scales)
    out = torch.full_like(args[0], float("nan"))
    got = extend_attention(*args, max_q_len=max(args[3].diff().tolist()), out=out, **dev_scales, **kw)
    assert got.data_ptr() == out.data_ptr()
    return got


def triton_decode(args, scales, device: str, splits: int, **kw) -> torch.Tensor:
    (q, k, v, _, kv_indptr, kv_indices), dev_scales = on_device(device, args, scales)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k, v, kv_indptr, kv_indices, num_kv_splits=splits, out=out, **dev_scales, **kw)
    assert got.data_ptr() == out.data_ptr()
    return got


# ---------------------------------------------------------------- the definition itself


def test_the_definition_is_a_scaled_softmax() -> None:
    """The column form equals o * sigmoid(L - s) for the uncapped row, and `add_sinks_`
    (the cascade's sink, given `attention_lse`'s log-sum-exp) is that formula."""
    args, _ = make_case([1] * 4, [5, 9, 17, 33], 4, 2, 16, torch.float32)
    sinks = make_sinks("mixed", 4)
    want = dense_attention(*args, sm_scale=0.3, sinks=sinks)
    plain = dense_attention(*args, sm_scale=0.3, sinks=None)
    q, k, v, _, kv_indptr, kv_indices = args
    for b in range(4):
        slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        keys = k[slots].transpose(0, 1).repeat_interleave(2, dim=0)[None]  # [1, Hq, L, D]
        values = v[slots].transpose(0, 1).repeat_interleave(2, dim=0)[None]
        o, lse = attention_lse(q[b][None, :, None], keys, values, scale=0.3)  # [1, Hq, 1, D], [1, Hq, 1]
        scaled = add_sinks_(o[0, :, 0], lse[0, :, 0], sinks)  # [Hq, D]
        torch.testing.assert_close(scaled.double(), want[b], atol=1e-6, rtol=1e-5)
        lse64 = (torch.einsum("hd,hld->hl", q[b].double(), keys[0].double()) * 0.3).logsumexp(-1)  # [Hq]
        ratio = torch.sigmoid(lse64 - sinks.double())[:, None]
        torch.testing.assert_close(plain[b] * ratio, want[b], atol=1e-12, rtol=1e-9)


# ---------------------------------------------------------------- references vs the definition


@pytest.mark.parametrize(("kind", "window", "softcap", "hq", "hkv", "storage"), [  # every pair of values
    (kind, window, softcap, *[(4, 4), (8, 2)][(k + w + c) % 2], [None, torch.int8][(k + w) % 2])
    for k, kind in enumerate(SINKS) for w, window in enumerate([None, 6]) for c, softcap in enumerate([None, 2.0])
])
def test_references_match_the_definition(
    kind: str, window: int | None, softcap: float | None, hq: int, hkv: int, storage: torch.dtype | None,
) -> None:
    sinks = make_sinks(kind, hq)
    kw = {"sm_scale": 0.3, "window": window, "softcap": softcap, "sinks": sinks}
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 16, torch.float32, storage)
    got = decode_attention_ref(*decode_args(args), **kw, **scales)
    assert_rows_close(got, dense_attention(*args, **kw, **scales), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no context
    args, scales = make_case(EXTEND_Q, EXTEND_KV, hq, hkv, 16, torch.float32, storage, seed=1)
    got = extend_attention_ref(*args, **kw, **scales)
    assert_rows_close(got, dense_attention(*args, **kw, **scales), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_reference_with_image_blocks(window: int | None, softcap: float | None) -> None:
    args, scales, until = image_case(8, 2, 16, torch.float32, torch.int8)
    kw = {"sm_scale": 0.3, "window": window, "softcap": softcap, "attend_until": until, "sinks": make_sinks("mixed", 8)}
    got = extend_attention_ref(*args, **kw, **scales)
    assert_rows_close(got, dense_attention(*args, **kw, **scales), atol=1e-5, rtol=1e-5)


def test_references_read_only_what_the_window_shows() -> None:
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 16, torch.float32)
    kw = {"sm_scale": 0.3, "window": 5, "sinks": make_sinks("mixed", 8)}
    want = dense_attention(*args, **kw)
    assert poison_unseen(args, scales, 5) > 0
    assert_rows_close(extend_attention_ref(*args, **kw), want, atol=1e-5, rtol=1e-5)


def test_sinks_none_is_the_path_without_sinks(force_triton: None) -> None:
    """sinks=None is the plain path to the bit (the SDPA reference, the kernels without the
    SINKS variant); a sink far below every score changes nothing beyond rounding; the
    mixed sinks change exactly the heads whose sink is not far below (they are applied,
    not dropped)."""
    args, _ = make_case(EXTEND_Q, EXTEND_KV, 4, 2, 32, torch.float32)
    for call in (extend_attention_ref, extend_attention_triton):
        kw = {} if call is extend_attention_ref else {"max_q_len": max(EXTEND_Q)}
        plain = call(*args, sm_scale=0.3, **kw)
        assert torch.equal(call(*args, sm_scale=0.3, sinks=None, **kw), plain)
        torch.testing.assert_close(call(*args, sm_scale=0.3, sinks=make_sinks("low", 4), **kw), plain,
                                   atol=1e-6, rtol=1e-6)
        changed = (call(*args, sm_scale=0.3, sinks=make_sinks("mixed", 4), **kw) - plain).abs().amax(dim=(0, 2))
        assert changed.gt(1e-3).tolist() == [True, False, True, True]
    decode = decode_args(make_case([1] * len(DECODE_LENS), DECODE_LENS, 4, 2, 32, torch.float32)[0])
    for call in (decode_attention_ref, decode_attention_triton):
        plain = call(*decode, sm_scale=0.3)
        assert torch.equal(call(*decode, sm_scale=0.3, sinks=None), plain)
        changed = (call(*decode, sm_scale=0.3, sinks=make_sinks("mixed", 4)) - plain).abs().amax(dim=(0, 2))
        assert changed.gt(1e-3).tolist() == [True, False, True, True]


@pytest.mark.parametrize("bad", ["float64", "bfloat16", "per kv head", "2-D", "strided"])
def test_sinks_are_checked(bad: str, force_triton: None) -> None:
    args, _ = make_case([1, 1], [4, 2], 4, 2, 16, torch.float32)
    good = make_sinks("mixed", 4)
    wrong = {
        "float64": good.double(),
        "bfloat16": good.bfloat16(),
        "per kv head": good[:2],
        "2-D": good[None],
        "strided": torch.stack([good, good], dim=1)[:, 0],
    }[bad]
    q, k, v, _, _, kv_indices = args
    calls = [
        lambda: request_attention_ref(q[:1], k, v, kv_indices[:4].long(), sm_scale=0.3, sinks=wrong),
        lambda: decode_attention_ref(*decode_args(args), sm_scale=0.3, sinks=wrong),
        lambda: decode_attention(*decode_args(args), sm_scale=0.3, sinks=wrong),
        lambda: extend_attention_ref(*args, sm_scale=0.3, sinks=wrong),
        lambda: extend_attention(*args, sm_scale=0.3, max_q_len=1, sinks=wrong),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="attention sinks are one float32 entry per query head"):
            call()


# ---------------------------------------------------------------- Triton vs the definition


@pytest.mark.parametrize(("kind", "window", "softcap", "hq", "hkv", "splits"), [
    *(case + [(8, 2, 1), (4, 1, 4)][i % 2] for i, case in enumerate(TRITON_CASES)),
    ("mixed", 6, 5.0, 4, 4, 16),  # 16: empty splits, merged with the sink
])
def test_decode_triton_matches_the_definition(
    kind: str, window: int | None, softcap: float | None, hq: int, hkv: int, splits: int,
    device: str, force_triton: None,
) -> None:
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, hq, hkv, 64, torch.float32)
    kw = {"sm_scale": 0.25, "window": window, "softcap": softcap}
    want = dense_attention(*args, sinks=make_sinks(kind, hq), **kw)
    got = triton_decode(args, scales, device, splits, sinks=make_sinks(kind, hq, device), **kw)
    assert_rows_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("kind", "window", "softcap", "hq", "hkv"), [
    case + [(8, 2), (4, 4)][i % 2] for i, case in enumerate(TRITON_CASES)
])
def test_extend_triton_matches_the_definition(
    kind: str, window: int | None, softcap: float | None, hq: int, hkv: int, device: str, force_triton: None,
) -> None:
    args, scales = make_case(EXTEND_Q, EXTEND_KV, hq, hkv, 64, torch.float32)
    kw = {"sm_scale": 0.25, "window": window, "softcap": softcap}
    want = dense_attention(*args, sinks=make_sinks(kind, hq), **kw)
    got = triton_extend(args, scales, device, sinks=make_sinks(kind, hq, device), **kw)
    assert_rows_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (4, 2.0), (60, None)])
def test_extend_triton_with_image_blocks(window: int | None, softcap: float | None, device: str,
                                         force_triton: None) -> None:
    args, scales, until = image_case(4, 2, 32, torch.float32)
    kw = {"sm_scale": 0.2, "window": window, "softcap": softcap}
    want = dense_attention(*args, attend_until=until, sinks=make_sinks("mixed", 4), **kw)
    got = triton_extend(args, scales, device, attend_until=until.to(device), sinks=make_sinks("mixed", 4, device), **kw)
    assert_rows_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "storage", "window", "softcap"), [
    (torch.float32, torch.int8, 5, 5.0),
    (torch.bfloat16, torch.int8, 37, 2.0),
    (torch.bfloat16, None, None, None),
    (torch.float16, None, 6, None),
])
def test_triton_in_16_bit_and_over_int8_pools(
    dtype: torch.dtype, storage: torch.dtype | None, window: int | None, softcap: float | None,
    device: str, force_triton: None, tol: dict[torch.dtype, dict[str, float]],
) -> None:
    kw = {"sm_scale": 0.25, "window": window, "softcap": softcap}
    args, scales = make_case([1] * len(DECODE_LENS), DECODE_LENS, 8, 2, 64, dtype, storage)
    want = dense_attention(*args, sinks=make_sinks("mixed", 8), **kw, **scales)
    got = triton_decode(args, scales, device, 3, sinks=make_sinks("mixed", 8, device), **kw)
    assert got.dtype == dtype
    assert_rows_close(got, want, **tol[dtype])
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 64, dtype, storage, seed=1)
    want = dense_attention(*args, sinks=make_sinks("mixed", 8), **kw, **scales)
    got = triton_extend(args, scales, device, sinks=make_sinks("mixed", 8, device), **kw)
    assert_rows_close(got, want, **tol[dtype])


def test_triton_reads_only_what_the_window_shows(device: str, force_triton: None) -> None:
    args, scales = make_case(EXTEND_Q, EXTEND_KV, 8, 2, 64, torch.float32, torch.int8)
    kw = {"sm_scale": 0.25, "window": 6}
    want = dense_attention(*args, sinks=make_sinks("mixed", 8), **kw, **scales)
    assert poison_unseen(args, scales, 6) > 0
    assert_rows_close(triton_extend(args, scales, device, sinks=make_sinks("mixed", 8, device), **kw), want,
                      atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- compiled, on a real GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (128, None), (None, 30.0)])
def test_gpu_long_contexts(window: int | None, softcap: float | None) -> None:
    sinks = torch.linspace(-20.0, 20.0, 32, device="cuda")
    kw = {"sm_scale": 128**-0.5, "window": window, "softcap": softcap, "sinks": sinks}
    args, _ = make_case([1] * 4, [4096, 1, 777, 2048], 32, 8, 128, torch.bfloat16)
    q, k, v, _, kv_indptr, kv_indices = (t.cuda() for t in args)
    got = decode_attention(q, k, v, kv_indptr, kv_indices, num_kv_splits=16, **kw)
    assert_rows_close(got, decode_attention_ref(q, k, v, kv_indptr, kv_indices, **kw).double().cpu(),
                      atol=2e-2, rtol=2e-2)
    args, _ = make_case([1000, 1, 333], [1000, 2001, 850], 32, 8, 128, torch.bfloat16)
    args = tuple(t.cuda() for t in args)
    got = extend_attention(*args, max_q_len=1000, **kw)
    assert_rows_close(got, extend_attention_ref(*args, **kw).double().cpu(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_decode_with_sinks_replays_in_a_cuda_graph() -> None:
    """A captured decode step reads the sinks on the device at each replay: new values
    written into the same tensor (a parameter's fixed address) change the replayed
    output as they change the eager one."""
    args, _ = make_case([1] * 4, [300, 1, 77, 129], 8, 2, 64, torch.bfloat16)
    q, k, v, _, kv_indptr, kv_indices = (t.cuda() for t in args)
    sinks = make_sinks("low", 8, "cuda")
    out = torch.empty_like(q)

    def step() -> None:
        decode_attention(q, k, v, kv_indptr, kv_indices, sm_scale=0.125, num_kv_splits=4, out=out, sinks=sinks)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for kind in ("mixed", "high"):
        sinks.copy_(make_sinks(kind, 8, "cuda"))
        graph.replay()
        want = dense_attention(*args, sm_scale=0.125, sinks=sinks.cpu())
        assert_rows_close(out, want, atol=2e-2, rtol=2e-2)
