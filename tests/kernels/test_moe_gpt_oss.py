"""gpt-oss's experts: MXFP4 against transformers' dequantization; the torch reference with
biases and the clamped SwiGLU against transformers' `GptOssExperts`; the Triton path against
the reference for every option (float or MXFP4 w13 and w2, biases, either activation);
each token's output the same alone as in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from sprig.kernels.moe import ClampedSwiGLU, fused_experts, fused_experts_ref, route_topk
from sprig.kernels.mxfp4 import Mxfp4Weight, dequantize_mxfp4, quantize_mxfp4

GPT_OSS = ClampedSwiGLU(alpha=1.702, limit=7.0)


def _codes(E: int, N: int, K: int, g: torch.Generator, scales: tuple[int, int]) -> Mxfp4Weight:
    """Random MXFP4 codes (all 16) with scale bytes in [lo, hi]."""
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, generator=g)
    return Mxfp4Weight(blocks, torch.randint(scales[0], scales[1] + 1, (E, N, K // 32), dtype=torch.uint8, generator=g))


def _float(w: torch.Tensor | Mxfp4Weight, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_mxfp4(w.blocks, w.scales, dtype) if isinstance(w, Mxfp4Weight) else w.to(dtype)


# --- MXFP4 -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    w = _codes(3, 5, 128, torch.Generator().manual_seed(0), scales=(110, 140))
    assert w.shape == (3, 5, 128)
    expected = convert_moe_packed_tensors(w.blocks, w.scales, dtype=dtype).transpose(1, 2)
    got = dequantize_mxfp4(w.blocks, w.scales, dtype)
    assert got.dtype == dtype and torch.equal(got, expected)


def test_dequantize_reads_each_nibble_and_scale_exactly() -> None:
    """Element 2j is byte j's low nibble; every code at every scale byte 0..254 (in float64,
    then float32: exact, or infinite past its range)."""
    lo, hi = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    byte = (lo | hi << 4).reshape(1, 1, 1, 256).to(torch.uint8)  # every (low, high) pair
    blocks = byte.reshape(1, 1, 16, 16).expand(1, 255, 16, 16).contiguous()
    scales = torch.arange(255, dtype=torch.uint8).reshape(1, 255, 1).expand(1, 255, 16).contiguous()
    got = dequantize_mxfp4(blocks, scales, torch.float32)  # [1, 255, 512]
    codes = torch.stack((lo.reshape(-1), hi.reshape(-1)), -1).reshape(-1)  # [512] in k order
    table = torch.tensor(FP4_VALUES, dtype=torch.float64)
    expected = table[codes][None, :] * 2.0 ** (torch.arange(255, dtype=torch.float64) - 127)[:, None]
    assert torch.equal(got[0], expected.float())


def test_quantize_rounds_to_the_nearest_value_ties_to_even() -> None:
    """With the group's largest |w| = 6, the scale is 1: each midpoint goes to its even code."""
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.1, 0.3, -2.9, 7.0 / 8, 0.0])
    w = torch.cat((row, torch.zeros(32 - row.numel())))[None, :]
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    got = dequantize_mxfp4(blocks, scales, torch.float32)[0, : row.numel()]
    assert got.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 0.5, -3.0, 1.0, 0.0]
    assert not (blocks & 0x0F == 8).any() and not (blocks >> 4 == 8).any()  # no -0 codes


def test_quantize_picks_the_smallest_scale_and_the_nearest_grid_value() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 6, 96, generator=g) * torch.logspace(-3, 3, 96)  # groups of many magnitudes
    blocks, scales = quantize_mxfp4(w)
    scale = 2.0 ** (scales.double() - 127)  # [4, 6, 3]
    amax = w.double().abs().reshape(4, 6, 3, 32).amax(-1)
    assert (amax <= 6 * scale).all() and (amax > 3 * scale).all()
    q = dequantize_mxfp4(blocks, scales, torch.float64).reshape(4, 6, 3, 32)
    grid = torch.tensor(FP4_VALUES, dtype=torch.float64)  # [16]
    candidates = grid * scale[..., None, None]  # [4, 6, 3, 1, 16]
    dist = (candidates - w.double().reshape(4, 6, 3, 32, 1)).abs()
    assert torch.equal((q - w.double().reshape(4, 6, 3, 32)).abs(), dist.amin(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_inverts_dequantize(dtype: torch.dtype) -> None:
    """Codes without -0, each group's largest magnitude 4 or 6: the codes and scales return."""
    g = torch.Generator().manual_seed(2)
    w = _codes(2, 7, 64, g, scales=(100, 150))
    codes = torch.stack((w.blocks & 0xF, w.blocks >> 4), -1).flatten(-2)  # [2, 7, 2, 32]
    codes = torch.where(codes == 8, 0, codes)
    top = torch.randint(6, 8, codes.shape[:-1], generator=g, dtype=torch.uint8) | torch.randint(
        0, 2, codes.shape[:-1], generator=g, dtype=torch.uint8) << 3  # 4 or 6, either sign
    codes = torch.minimum(codes & 7, top[..., None] & 7) | codes & 8
    codes[..., 5] = top
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    back = quantize_mxfp4(dequantize_mxfp4(blocks, w.scales, dtype))
    assert torch.equal(back[0], blocks) and torch.equal(back[1], w.scales)


# --- the torch reference -------------------------------------------------------------------


def _transformers_experts(E: int, H: int, inter: int, K: int, seed: int) -> GptOssExperts:
    config = GptOssConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=K,
                          swiglu_limit=GPT_OSS.limit)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    assert experts.alpha == GPT_OSS.alpha
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, H, 2 * inter, generator=g) / H**0.5)
        experts.gate_up_proj_bias.copy_(torch.randn(E, 2 * inter, generator=g))
        experts.down_proj.copy_(torch.randn(E, inter, H, generator=g) / inter**0.5)
        experts.down_proj_bias.copy_(torch.randn(E, H, generator=g))
    return experts


def _clamp_hits(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, ids: torch.Tensor) -> tuple[bool, bool]:
    """Whether some routed gate exceeds the limit, and some routed |up| does."""
    h = torch.einsum("th,tkih->tki", x.double(), w13.double()[ids]) + b13.double()[ids]
    return bool((h[..., 0::2] > GPT_OSS.limit).any()), bool((h[..., 1::2].abs() > GPT_OSS.limit).any())


@pytest.mark.parametrize(("T", "E", "K"), [(1, 4, 1), (6, 4, 2), (11, 5, 3), (16, 6, 4)])
def test_reference_equals_transformers_gpt_oss_experts(T: int, E: int, K: int) -> None:
    H, inter = 48, 40
    experts = _transformers_experts(E, H, inter, K, seed=T)
    g = torch.Generator().manual_seed(100 + T)
    x = 3 * torch.randn(T, H, generator=g)
    top, ids = torch.topk(torch.randn(T, E, generator=g), K, dim=-1)  # as GptOssTopKRouter
    weights = torch.softmax(top, dim=-1)
    with torch.no_grad():
        expected = experts(x, ids, weights)
    w13 = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], interleaved rows
    w2 = experts.down_proj.detach().transpose(1, 2)  # [E, H, I]
    b13, b2 = experts.gate_up_proj_bias.detach(), experts.down_proj_bias.detach()
    if T > 1:
        assert _clamp_hits(x, w13, b13, ids) == (True, True)
    got = fused_experts(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=GPT_OSS)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reference_swiglu_with_biases_equals_the_definition() -> None:
    """The plain layout (gate rows, then up rows) with biases, token by token in float64."""
    T, E, K, H, inter = 9, 4, 2, 24, 20
    x, w13, w2, b13, b2, weights, ids = _case(T, E, K, H, inter, torch.float32, seed=5)
    expected = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            h = x[t].double() @ w13[e].double().T + b13[e].double()
            y = (F.silu(h[:inter]) * h[inter:]) @ w2[e].double().T + b2[e].double()
            expected[t] += float(weights[t, k]) * y
    got = fused_experts_ref(x, w13, w2, weights, ids, b13=b13, b2=b2)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["w13", "w2", "both"])
def test_reference_mxfp4_equals_its_dequantized_weights(which: str, dtype: torch.dtype) -> None:
    x, w13, w2, b13, b2, weights, ids = _case(13, 5, 3, 64, 32, dtype, seed=6, fp4=which)
    got = fused_experts_ref(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=GPT_OSS)
    expected = fused_experts_ref(x, _float(w13, dtype), _float(w2, dtype), weights, ids, b13=b13, b2=b2,
                                 activation=GPT_OSS)
    assert torch.equal(got, expected)


# --- the Triton path -----------------------------------------------------------------------


def _case(T: int, E: int, K: int, H: int, inter: int, dtype: torch.dtype, seed: int, fp4: str = "none"):
    """x scaled so that gates pass the clamp; float weights in dtype, or MXFP4 codes for
    `fp4` in ("w13", "w2", "both"); float32 biases; routing from random logits."""
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(T, H, generator=g)).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype)
    if fp4 in ("w13", "both"):
        w13 = _codes(E, 2 * inter, H, g, scales=(120, 123))
    if fp4 in ("w2", "both"):
        w2 = _codes(E, H, inter, g, scales=(120, 123))
    b13 = torch.randn(E, 2 * inter, generator=g)
    b2 = torch.randn(E, H, generator=g)
    weights, ids = route_topk(torch.randn(T, E, generator=g), K, renormalize=True)
    return x, w13, w2, b13, b2, weights, ids


def _to(value, device: str):
    if isinstance(value, Mxfp4Weight):
        return Mxfp4Weight(value.blocks.to(device), value.scales.to(device))
    return value.to(device)


VARIANTS = {  # name: (fp4, activation, biases)
    "swiglu_biases": ("none", None, True),
    "clamped": ("none", GPT_OSS, False),
    "clamped_biases": ("none", GPT_OSS, True),
    "fp4_w13": ("w13", GPT_OSS, True),
    "fp4_w2": ("w2", None, True),
    "fp4_both": ("both", GPT_OSS, True),
}


@pytest.mark.parametrize(("variant", "T", "K", "dtype"), [  # every pair of values
    (variant, T, K, [torch.float32, torch.bfloat16][(i + j) % 2])
    for i, variant in enumerate(VARIANTS) for j, (T, K) in enumerate([(0, 2), (1, 1), (6, 2), (13, 3), (19, 4)])
])
def test_triton_matches_the_reference(
    variant: str, T: int, K: int, dtype: torch.dtype, device: str, force_triton: None, tol: dict
) -> None:
    fp4, activation, biases = VARIANTS[variant]
    E, H, inter = 5, 64, 96
    x, w13, w2, b13, b2, weights, ids = _case(T, E, K, H, inter, dtype, seed=T + 7 * K, fp4=fp4)
    if not biases:
        b13 = b2 = None
    if activation is not None and T > 6:
        assert _clamp_hits(x, _float(w13, torch.float32), b13 if biases else torch.zeros(E, 2 * inter), ids)[0]
    got = fused_experts(*(_to(v, device) for v in (x, w13, w2, weights, ids)),
                        b13=None if b13 is None else b13.to(device), b2=None if b2 is None else b2.to(device),
                        activation=activation)
    expected = fused_experts_ref(x, w13, w2, weights, ids, b13=b13, b2=b2, activation=activation)
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.bfloat16:  # outputs of size ~10: the interpreter's bf16 rounding toward zero scales with them
        size = max(1.0, float(expected.float().pow(2).mean().sqrt())) if T else 1.0
        torch.testing.assert_close(got.cpu(), expected, atol=0.15 * size, rtol=tol[dtype]["rtol"])
    else:
        torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


@pytest.mark.parametrize("fp4", ["none", "both"])
def test_rows_do_not_depend_on_the_batch(fp4: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token's output alone equals its output among others sharing its experts: bitwise on
    the Triton path on CUDA; to float32 rounding on the reference, and on the interpreter,
    whose `tl.dot` is numpy's matmul: on some CPUs (AMD EPYC, OpenBLAS 0.3.31) that rounds
    a row differently by its place in the block."""
    x, w13, w2, b13, b2, weights, ids = _case(12, 4, 2, 64, 32, torch.float32, seed=8, fp4=fp4)
    for triton in (False, True):
        monkeypatch.setenv("SPRIG_FORCE_TRITON", "1" if triton else "0")
        dev = device if triton else "cpu"
        args = [_to(v, dev) for v in (x, w13, w2, weights, ids, b13, b2)]
        together = fused_experts(*args[:5], b13=args[5], b2=args[6], activation=GPT_OSS)
        for t in (0, 5, 11):
            alone = fused_experts(args[0][t : t + 1], args[1], args[2], args[3][t : t + 1], args[4][t : t + 1],
                                  b13=args[5], b2=args[6], activation=GPT_OSS)
            if triton and device == "cuda":
                assert torch.equal(alone[0].cpu(), together[t].cpu()), t
            else:  # the CPU's matmul may sum in another order for one row
                torch.testing.assert_close(alone[0], together[t], atol=1e-5, rtol=1e-6)
