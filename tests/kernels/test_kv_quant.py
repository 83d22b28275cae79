"""Quantized KV pools in the kernels: the rule (`kv_quant`), the store kernel quantizing on
store, and decode / extend attention dequantizing on load, Triton against the torch
reference with the same quantization, and the reference over a quantized pool against
the reference over the float pool its dequantized values make."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels import (
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
    store_kv,
    store_kv_ref,
)
from sprig.kernels.kv_quant import SCALE_DTYPE, dequantize_kv_ref, qmax, quantize_kv_ref

STORAGE = [torch.int8, torch.float8_e4m3fn]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (float8 NaN-safe comparison of stored values)."""
    return t.view(torch.uint8)


# ---------------------------------------------------------------- the rule


def test_int8_rows_get_their_own_scale_and_round_half_away_from_zero() -> None:
    x = torch.tensor([
        [[127.0, -63.5, 0.5, -0.5, 1.49, 0.0]],
        [[63.5, -31.75, 0.25, -0.75, 1.2, 0.0]],
        [[2.54, 0.0, 0.0, -1.27, 0.0, 0.0]],
    ])  # [3, 1, 6]
    q, scale = quantize_kv_ref(x, torch.int8)
    assert q.dtype == torch.int8 and scale.dtype == SCALE_DTYPE and scale.shape == (3, 1)
    assert scale[0, 0] == 1.0 and q[0, 0].tolist() == [127, -64, 1, -1, 1, 0]  # scale 127 / 127
    assert scale[1, 0] == 0.5 and q[1, 0].tolist() == [127, -64, 1, -2, 2, 0]  # scale 63.5 / 127
    assert scale[2, 0] == torch.tensor(2.54 / 127).half()  # max |x| / 127, rounded to float16
    assert q[2, 0, 0] == 127


def test_zero_rows_store_scale_one_and_dequantize_to_zero() -> None:
    x = torch.zeros(3, 2, 8)
    x[1, 1, 3] = 1e-9  # max / 127 underflows float16: guarded like a zero row
    for dtype in STORAGE:
        q, scale = quantize_kv_ref(x, dtype)
        assert torch.equal(scale, torch.ones(3, 2, dtype=SCALE_DTYPE))
        assert torch.equal(dequantize_kv_ref(q, scale, torch.float32), torch.zeros(3, 2, 8))


@pytest.mark.parametrize("dtype", STORAGE)
def test_dequantized_rows_are_within_half_a_step(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    q, scale = quantize_kv_ref(x, dtype)
    back = dequantize_kv_ref(q, scale, torch.float32)
    step = scale.float().unsqueeze(-1)  # [64, 4, 1]
    if dtype == torch.int8:
        assert int(q.abs().max()) == 127  # every row's largest value maps to +-127
        assert bool(((back - x).abs() <= 0.5 * step * 1.001).all())
    else:  # e4m3: 3 mantissa bits, relative half-step 1/16 above the subnormals
        assert bool(((back - x).abs() <= x.abs() / 16 + step * 2**-10).all())
    # float32(q) * scale is exact: dequantizing in float64 gives the same values
    assert torch.equal(back.double(), q.double() * scale.double().unsqueeze(-1))


def test_dequantized_rows_round_to_the_model_dtype() -> None:
    q, scale = quantize_kv_ref(torch.randn(5, 2, 16), torch.int8)
    got = dequantize_kv_ref(q, scale, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequantize_kv_ref(q, scale, torch.float32).to(torch.bfloat16))


def test_qmax_and_refusals() -> None:
    assert qmax(torch.int8) == 127.0 and qmax(torch.float8_e4m3fn) == 448.0
    with pytest.raises(ValueError, match="not a quantized"):
        qmax(torch.bfloat16)
    k_buf, v_buf = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    scales = torch.ones(8, 2, dtype=SCALE_DTYPE)
    with pytest.raises(ValueError, match="scales exactly when"):
        store_kv_ref(k_buf, v_buf, torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4), k_scale=scales, v_scale=scales)
    with pytest.raises(ValueError, match="scales exactly when"):
        store_kv_ref(k_buf.to(torch.int8), v_buf.to(torch.int8), torch.tensor([1]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="float16"):
        store_kv_ref(k_buf.to(torch.int8), v_buf.to(torch.int8), torch.tensor([1]), torch.ones(1, 2, 4),
                     torch.ones(1, 2, 4), k_scale=scales.float(), v_scale=scales.float())


# ---------------------------------------------------------------- store: Triton vs reference


def _quantized_pool(slots: int, hkv: int, d: int, storage: torch.dtype, seed: int):
    """A pool of random quantized K/V and its scales: (k, v, k_scale, v_scale)."""
    g = torch.Generator().manual_seed(seed)
    k, k_scale = quantize_kv_ref(torch.randn(slots, hkv, d, generator=g) * 2, storage)
    v, v_scale = quantize_kv_ref(torch.randn(slots, hkv, d, generator=g), storage)
    return k, v, k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("hkv", "d"), [(2, 80), (1, 64), (12, 32), (3, 128)])
def test_store_kv_triton_quantizes_bit_for_bit(
    dtype: torch.dtype, hkv: int, d: int, device: str, force_triton: None
) -> None:
    g = torch.Generator().manual_seed(hkv * d)
    loc = torch.tensor([5, 1, 39, 17, 6, 22], dtype=torch.int32)
    k = (torch.randn(6, hkv, d, generator=g) * 5).to(dtype)
    v = (torch.randn(6, hkv, d, generator=g) * torch.logspace(-4, 2, 6)[:, None, None]).to(dtype)
    k[2] = 0  # a zero row
    want = _quantized_pool(40, hkv, d, torch.int8, seed=1)
    got = [t.clone().to(device) for t in want]
    store_kv_ref(want[0], want[1], loc, k, v, k_scale=want[2], v_scale=want[3])
    store_kv(got[0], got[1], loc.to(device), k.to(device), v.to(device), k_scale=got[2], v_scale=got[3])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a.cpu()), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_triton_fp8_on_gpu(dtype: torch.dtype) -> None:
    """The interpreter's float32 -> e4m3 cast rounds wrongly at binade edges; compiled
    kernels convert like torch."""
    g = torch.Generator().manual_seed(3)
    loc = torch.randperm(200, generator=g)[:64].add(1)
    k = (torch.randn(64, 8, 128, generator=g) * 3).to(dtype)
    v = torch.randn(64, 8, 128, generator=g).to(dtype)
    want = _quantized_pool(256, 8, 128, torch.float8_e4m3fn, seed=2)
    got = [t.clone().cuda() for t in want]
    store_kv_ref(want[0], want[1], loc, k, v, k_scale=want[2], v_scale=want[3])
    store_kv(got[0], got[1], loc.cuda(), k.cuda(), v.cuda(), k_scale=got[2], v_scale=got[3])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a.cpu()), _bits(b))


# ---------------------------------------------------------------- attention: dequantize on load


def _indptr(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _decode_args(lens, hq, hkv, d, dtype, storage, seed=0):
    pool = sum(lens) + 5
    k, v, ks, vs = _quantized_pool(pool, hkv, d, storage, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    slots = (torch.randperm(pool - 1, generator=g)[: sum(lens)] + 1).to(torch.int32)
    return (q, k, v, _indptr(lens), slots), {"k_scale": ks, "v_scale": vs}


def _extend_args(q_lens, prefixes, hq, hkv, d, dtype, storage, seed=0):
    kv_lens = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
    pool = sum(kv_lens) + 7
    k, v, ks, vs = _quantized_pool(pool, hkv, d, storage, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    slots = (torch.randperm(pool - 1, generator=g)[: sum(kv_lens)] + 1).to(torch.int32)
    return (q, k, v, _indptr(q_lens), _indptr(kv_lens), slots), {"k_scale": ks, "v_scale": vs}


def _dequantized(args: tuple, scales: dict) -> tuple:
    """The same arguments over the float pool (in q's dtype) that the quantized one reads as."""
    q, k, v, *meta = args
    return (q, dequantize_kv_ref(k, scales["k_scale"], q.dtype), dequantize_kv_ref(v, scales["v_scale"], q.dtype), *meta)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_read_exactly_the_dequantized_pool(storage: torch.dtype, dtype: torch.dtype) -> None:
    args, scales = _decode_args([5, 0, 23, 40], 8, 2, 32, dtype, storage)
    got = decode_attention_ref(*args, sm_scale=0.2, **scales)
    assert torch.equal(got, decode_attention_ref(*_dequantized(args, scales), sm_scale=0.2))
    args, scales = _extend_args([3, 1, 6, 2], [0, 4, 5, 9], 4, 1, 32, dtype, storage)
    got = extend_attention_ref(*args, sm_scale=0.2, **scales)
    assert torch.equal(got, extend_attention_ref(*_dequantized(args, scales), sm_scale=0.2))
    # and not the raw stored values
    q, k, v, *meta = args
    assert not torch.allclose(got.float(), extend_attention_ref(q, k.to(dtype), v.to(dtype), *meta, sm_scale=0.2).float())


DECODE_CASES = [
    # hq, hkv, d, dtype, storage, lens, splits
    (4, 4, 64, torch.float32, torch.int8, [1, 37, 0, 130], 4),
    (8, 2, 128, torch.float16, torch.int8, [65, 3], 8),
    (8, 1, 80, torch.float32, torch.int8, [19, 100], 3),
    (16, 2, 64, torch.bfloat16, torch.int8, [50, 7, 1], 2),
    (8, 4, 64, torch.float32, torch.float8_e4m3fn, [40, 0, 2], None),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "storage", "lens", "splits"), DECODE_CASES)
def test_decode_triton_dequantizes_like_the_reference(
    hq: int, hkv: int, d: int, dtype: torch.dtype, storage: torch.dtype, lens: list[int], splits: int | None,
    device: str, force_triton: None, tol: dict,
) -> None:
    args, scales = _decode_args(lens, hq, hkv, d, dtype, storage)
    expected = decode_attention_ref(*args, sm_scale=d**-0.5, **scales)
    got = decode_attention(
        *(t.to(device) for t in args), sm_scale=d**-0.5, num_kv_splits=splits,
        **{name: s.to(device) for name, s in scales.items()},
    )
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


EXTEND_CASES = [
    # hq, hkv, d, dtype, storage, q_lens, prefix_lens
    (4, 4, 64, torch.float32, torch.int8, [1, 5, 70, 3], [0, 9, 3, 100]),
    (8, 2, 128, torch.float16, torch.int8, [17, 1], [0, 40]),
    (8, 1, 64, torch.bfloat16, torch.int8, [6, 11], [13, 0]),
    (4, 2, 80, torch.float32, torch.float8_e4m3fn, [9, 2], [0, 30]),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype", "storage", "q_lens", "prefixes"), EXTEND_CASES)
def test_extend_triton_dequantizes_like_the_reference(
    hq: int, hkv: int, d: int, dtype: torch.dtype, storage: torch.dtype, q_lens: list[int], prefixes: list[int],
    device: str, force_triton: None, tol: dict,
) -> None:
    args, scales = _extend_args(q_lens, prefixes, hq, hkv, d, dtype, storage)
    expected = extend_attention_ref(*args, sm_scale=d**-0.5, **scales)
    got = extend_attention(
        *(t.to(device) for t in args), sm_scale=d**-0.5, max_q_len=max(q_lens),
        **{name: s.to(device) for name, s in scales.items()},
    )
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])
