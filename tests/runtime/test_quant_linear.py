"""Quantized weights below the model: RTN, act-order reordering, and every matmul against
the plain dequantize-then-matmul reference, batch-invariant on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sprig.runtime.quantization.matmul import (
    MATMULS,
    DequantMatmul,
    Float8CPU,
    Int4CPU,
    Int8PerChannelCPU,
    build_matmul,
)
from sprig.runtime.quantization.weight import QuantizedWeight, QuantScheme, quantize_rtn

CPU = torch.device("cpu")


def _weight(n: int, k: int, scheme: QuantScheme, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    return quantize_rtn(torch.randn(n, k, generator=g) * 0.1, scheme)


@pytest.mark.parametrize(
    "scheme", [QuantScheme(8), QuantScheme(8, 32, symmetric=False), QuantScheme(4, 32), QuantScheme(4, None, symmetric=False)]
)
def test_rtn_error_is_at_most_half_a_step(scheme: QuantScheme) -> None:
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    q = quantize_rtn(w, scheme)
    assert q.qweight.dtype == torch.uint8 and int(q.qweight.max()) < 1 << scheme.bits
    step = q.scales.repeat_interleave(128 // q.scales.shape[1], 1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    if scheme.symmetric:
        assert (q.zeros == scheme.mid).all()


# (name, scheme, N, K): which CPU matmul runs each, and shapes that exercise its edges
CPU_CASES = [
    ("int8-sym", QuantScheme(8), 40, 96, Int8PerChannelCPU),
    ("int8-asym", QuantScheme(8, None, symmetric=False), 33, 64, Int8PerChannelCPU),
    ("int4-g32", QuantScheme(4, 32), 64, 128, Int4CPU),
    ("int4-g128-asym", QuantScheme(4, 128, symmetric=False), 48, 256, Int4CPU),
    ("int4-rows-padded", QuantScheme(4, 64), 40, 128, Int4CPU),
    ("int4-per-channel", QuantScheme(4, None), 32, 192, Int4CPU),  # runs as groups of 64
    ("int4-g16", QuantScheme(4, 16), 32, 64, DequantMatmul),  # too small for torch's kernel
    ("int8-g32", QuantScheme(8, 32, symmetric=False), 32, 64, DequantMatmul),
    ("fp8-per-channel", QuantScheme(8, float8=True), 40, 96, Float8CPU),
    ("fp8-g32", QuantScheme(8, 32, float8=True), 24, 64, Float8CPU),
]


@pytest.mark.parametrize(("name", "scheme", "n", "k", "cls"), CPU_CASES, ids=[c[0] for c in CPU_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_matmul_matches_the_dequantized_weight(
    name: str, scheme: QuantScheme, n: int, k: int, cls: type, dtype: torch.dtype
) -> None:
    weight = _weight(n, k, scheme)
    matmul = build_matmul(weight, dtype, CPU)
    assert type(matmul) is cls
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(2))
    want = F.linear(x, weight.dequantize())
    got = matmul(x.to(dtype))
    assert got.dtype == dtype and got.shape == (7, n)
    tol = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)


TORCH_KERNEL_CASES = [c for c in CPU_CASES if c[4] not in (DequantMatmul, Float8CPU)]


@pytest.mark.parametrize(("name", "scheme", "n", "k", "cls"), TORCH_KERNEL_CASES, ids=[c[0] for c in TORCH_KERNEL_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernel_rows_do_not_depend_on_the_batch(
    name: str, scheme: QuantScheme, n: int, k: int, cls: type, dtype: torch.dtype
) -> None:
    """A row's output is the same bits alone or in a batch of any size (the reference
    path's matmul, like the float model's F.linear, takes a GEMV path for one row)."""
    matmul = build_matmul(_weight(n, k, scheme), dtype, CPU)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    whole = matmul(x)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(0, 33)):
        assert torch.equal(matmul(x[rows]), whole[rows]), rows


def test_registry_prefers_torch_kernels_on_cpu_and_triton_on_cuda() -> None:
    assert MATMULS["cpu"] == (Float8CPU, Int8PerChannelCPU, Int4CPU, DequantMatmul)
    assert MATMULS["cuda"] == (DequantMatmul,)


@pytest.mark.parametrize("group", [None, 32])
def test_float8_rounding_is_e4m3_nearest(group: int | None) -> None:
    """Each weight is stored as the e4m3 value nearest to it over its scale (max|w| of its
    row or group over 448): off by at most half a step, 2**-4 of it for normal values and
    2**-10 of the scale below e4m3's smallest normal, 2**-6."""
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 0, 128)
    q = quantize_rtn(w, QuantScheme(8, group, float8=True))
    assert q.float8 and q.qweight.dtype == torch.uint8 and (q.zeros == 0).all()
    scale = q.scales.repeat_interleave(128 // q.scales.shape[1], 1)
    assert torch.allclose((w.abs() / scale).amax(1).reshape(24, -1) if group is None else
                          (w.abs() / scale).reshape(24, -1, group).amax(-1), torch.tensor(448.0))
    err = (q.dequantize() - w).abs()
    assert (err <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
    assert (err > 0).any()  # the weights really are rounded


def _act_order(weight: QuantizedWeight, seed: int) -> QuantizedWeight:
    """The same codes read as an act-order checkpoint: columns' groups shuffled."""
    k, size = weight.in_features, weight.group_size
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[order] = torch.arange(k) // size
    return QuantizedWeight(weight.qweight, weight.scales, weight.zeros, weight.bits, g_idx)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, symmetric=False), QuantScheme(8, 32)])
def test_act_order_columns_are_reordered_with_the_input(scheme: QuantScheme) -> None:
    weight = _act_order(_weight(32, 128, scheme), seed=4)
    adjacent, perm = weight.with_adjacent_groups()
    assert perm is not None and adjacent.g_idx is None
    assert torch.equal(adjacent.dequantize(), weight.dequantize()[:, perm])
    x = torch.randn(5, 128)
    got = build_matmul(adjacent, torch.float32, CPU)(x[:, perm])
    torch.testing.assert_close(got, F.linear(x, weight.dequantize()), atol=2e-5, rtol=1e-5)


def test_plain_g_idx_needs_no_reordering() -> None:
    weight = _weight(16, 64, QuantScheme(4, 32))
    plain = QuantizedWeight(weight.qweight, weight.scales, weight.zeros, 4, torch.arange(64) // 32)
    assert plain.with_adjacent_groups()[1] is None


def test_uneven_groups_are_refused() -> None:
    weight = _weight(16, 64, QuantScheme(4, 32))
    g_idx = torch.zeros(64, dtype=torch.long)
    g_idx[:20] = 1  # 20 and 44 columns: no packed kernel runs that
    with pytest.raises(ValueError, match="exactly 32 input columns in each group"):
        QuantizedWeight(weight.qweight, weight.scales, weight.zeros, 4, g_idx).with_adjacent_groups()


@pytest.mark.parametrize(("bits", "group", "message"), [(3, None, "bits in"), (4, 0, "group_size must be positive")])
def test_scheme_validation(bits: int, group: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantScheme(bits, group)
    with pytest.raises(ValueError, match="group size 48 does not divide in_features 64"):
        QuantScheme(4, 48).num_groups(64)


@pytest.mark.parametrize(
    "scheme", [QuantScheme(8, None, float8=True), QuantScheme(8, 32, float8=True), QuantScheme(8),
               QuantScheme(8, 32, symmetric=False), QuantScheme(4, 32)], ids=str,
)
def test_cuda_path_runs_through_the_triton_kernel(scheme: QuantScheme, monkeypatch: pytest.MonkeyPatch) -> None:
    """What CUDA runs for every weight (`DequantMatmul`: the Triton kernel, decoding e4m3
    for fp8), compiled on CUDA and in the interpreter on the CPU, equals the dequantized
    weight's product; 8-bit codes are packed from a transposed view, which must come out
    row-major."""
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    if device == CPU:
        monkeypatch.setenv("SPRIG_FORCE_TRITON", "1")
    weight = _weight(40, 64, scheme)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    got = DequantMatmul(weight, torch.float32, device)(x.to(device)).cpu()
    torch.testing.assert_close(got, F.linear(x, weight.dequantize()), atol=2e-5, rtol=1e-5)
