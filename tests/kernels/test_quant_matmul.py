"""The quantized matmul: its reference against a hand-written dequantization, the Triton
kernel (GEMM and split-K GEMV shapes) against the reference."""

from __future__ import annotations

import pytest
import torch

from sprig.kernels import pack_codes, quant_matmul, quant_matmul_ref
from sprig.kernels.quant_matmul import quant_matmul_triton, unpack_codes

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(m: int, n: int, k: int, group: int, bits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.uint8)
    scales = torch.rand(k // group, n, generator=g) * 0.05 + 0.01
    zeros = torch.randint(0, 1 << bits, (k // group, n), generator=g).float()
    x = torch.randn(m, k, generator=g)
    return x, codes, scales, zeros


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_and_puts_the_low_nibble_first(bits: int) -> None:
    _, codes, _, _ = _case(1, 24, 64, 64, bits)
    packed = pack_codes(codes, bits)
    assert packed.shape == (64 * bits // 8, 24) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)
    if bits == 4:
        assert torch.equal(packed[3], codes[6] | (codes[7] << 4))
    transposed = pack_codes(codes.T.contiguous().T, bits)  # the kernel reads rows: row-major always
    assert transposed.is_contiguous() and torch.equal(transposed, packed)


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_is_the_dequantized_product(bits: int) -> None:
    x, codes, scales, zeros = _case(5, 24, 96, 32, bits)
    w = torch.empty(96, 24, dtype=torch.float64)
    for kk in range(96):
        for nn in range(24):
            grp = kk // 32
            w[kk, nn] = (int(codes[kk, nn]) - float(zeros[grp, nn])) * float(scales[grp, nn])
    got = quant_matmul_ref(x, pack_codes(codes, bits), scales, zeros, bits=bits)
    torch.testing.assert_close(got.double(), x.double() @ w, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [(1, 48, 128, 32), (3, 80, 64, 64), (20, 40, 192, 64), (33, 16, 128, 128)],
)
def test_triton_matches_reference(
    m: int, n: int, k: int, group: int, bits: int, dtype: torch.dtype,
    device: str, force_triton: None, tol: dict,
) -> None:
    x, codes, scales, zeros = _case(m, n, k, group, bits, seed=m + n)
    x = x.to(dtype)
    qweight = pack_codes(codes, bits)
    expected = quant_matmul_ref(x, qweight, scales, zeros, bits=bits)
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = quant_matmul(*args, bits=bits)
    assert got.dtype == dtype and got.shape == (m, n)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.cpu().float() / scale, expected.float() / scale, **tol[dtype])


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k_shares_the_k_loop(split_k: int, device: str) -> None:
    """Every split count gives the product (K = 5 blocks of 64: splits of unequal size)."""
    x, codes, scales, zeros = _case(4, 32, 320, 64, 4, seed=7)
    qweight = pack_codes(codes, 4)
    expected = quant_matmul_ref(x, qweight, scales, zeros, bits=4)
    args = [t.to(device) for t in (x, qweight, scales, zeros)]
    got = quant_matmul_triton(*args, bits=4, split_k=split_k)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-5)


def test_empty_batch(device: str, force_triton: None) -> None:
    x, codes, scales, zeros = _case(0, 16, 64, 32, 4)
    out = quant_matmul(*(t.to(device) for t in (x, pack_codes(codes, 4), scales, zeros)), bits=4)
    assert out.shape == (0, 16)


def _float8_case(m: int, n: int, k: int, group: int, seed: int = 0):
    """Every e4m3 bit pattern but the NaNs (0x7f, 0xff), normal and subnormal, both signs."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (k, n), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    scales = torch.rand(k // group, n, generator=g) * 0.05 + 0.01
    return torch.randn(m, k, generator=g), codes, scales


def test_float8_reference_decodes_e4m3() -> None:
    x, codes, scales = _float8_case(3, 8, 64, 32)
    w = torch.tensor([[float(codes[i, j].view(torch.float8_e4m3fn).item()) for j in range(8)] for i in range(64)])
    want = x.double() @ (w.double() * scales.double().repeat_interleave(32, 0))
    got = quant_matmul_ref(x, codes, scales, torch.zeros_like(scales), bits=8, float8=True)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 48, 128, 128), (20, 40, 192, 64)])
def test_triton_float8_matches_reference(
    m: int, n: int, k: int, group: int, dtype: torch.dtype, device: str, force_triton: None, tol: dict,
) -> None:
    """The kernel's integer e4m3 decoding equals torch's float8 conversion (every code)."""
    x, codes, scales = _float8_case(m, n, k, group, seed=m)
    x = x.to(dtype)
    zeros = torch.zeros_like(scales)
    expected = quant_matmul_ref(x, codes, scales, zeros, bits=8, float8=True)
    got = quant_matmul(*(t.to(device) for t in (x, codes, scales, zeros)), bits=8, float8=True)
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(got.cpu().float() / scale, expected.float() / scale, **tol[dtype])
