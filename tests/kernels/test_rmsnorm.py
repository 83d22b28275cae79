"""rms_norm: the reference against HF LlamaRMSNorm, Olmo2RMSNorm and Gemma3RMSNorm, the
Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from sprig.kernels import rms_norm, rms_norm_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (5, 3, 32)])
def test_ref_matches_hf_bitwise(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    hidden = shape[-1]
    hf = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden))
    x = torch.randn(shape, dtype=dtype) * 3
    with torch.no_grad():
        expected = hf(x)
    got = rms_norm_ref(x, hf.weight.detach(), 1e-5)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ref_residual_is_norm_of_sum(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, r = torch.randn(2, 6, 48, dtype=dtype)
    w = torch.randn(48, dtype=dtype)
    y, s = rms_norm_ref(x, w, 1e-6, residual=r)
    assert s.dtype == dtype and torch.equal(s, x + r)
    assert torch.equal(y, rms_norm_ref(x + r, w, 1e-6))
    assert not torch.equal(y, rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 40), (3, 4, 128), (1, 33), (0, 16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_matches_ref(
    dtype: torch.dtype, shape: tuple[int, ...], with_residual: bool,
    device: str, force_triton: None, tol: dict,
) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype) * 2
    w = torch.randn(shape[-1], dtype=dtype)
    r = torch.randn(shape, dtype=dtype) if with_residual else None
    expected = rms_norm_ref(x, w, 1e-6, r)
    got = rms_norm(x.to(device), w.to(device), 1e-6, None if r is None else r.to(device))
    if with_residual:
        torch.testing.assert_close(got[0].cpu(), expected[0], **tol[dtype])
        torch.testing.assert_close(got[1].cpu(), expected[1], **tol[dtype])
    else:
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


def test_triton_float32_weight_on_half_input(device: str, force_triton: None, tol: dict) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.randn(64)  # float32 weight promotes the output, as in HF
    expected = rms_norm_ref(x, w, 1e-5)
    got = rms_norm(x.to(device), w.to(device), 1e-5)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), expected, **tol[torch.float16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, None])
def test_unit_offset_ref_matches_gemma_bitwise(dtype: torch.dtype, weight_dtype: torch.dtype | None) -> None:
    torch.manual_seed(4)
    hf = Gemma3RMSNorm(48, eps=1e-6).to(weight_dtype or dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48) * 0.5)
    x = torch.randn(6, 48, dtype=dtype) * 3
    with torch.no_grad():
        expected = hf(x)
    got = rms_norm_ref(x, hf.weight.detach(), 1e-6, unit_offset=True)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)
    assert not torch.equal(got, rms_norm_ref(x, hf.weight.detach(), 1e-6))
    r = torch.randn(6, 48, dtype=dtype)
    y, s = rms_norm_ref(x, hf.weight.detach(), 1e-6, r, unit_offset=True)
    with torch.no_grad():
        assert torch.equal(y, hf(x + r)) and torch.equal(s, x + r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_unit_offset_triton_matches_ref(
    dtype: torch.dtype, with_residual: bool, device: str, force_triton: None, tol: dict
) -> None:
    torch.manual_seed(5)
    x = torch.randn(9, 40, dtype=dtype) * 2
    w = torch.randn(40)  # a float32 weight: the output stays in x's dtype
    r = torch.randn(9, 40, dtype=dtype) if with_residual else None
    expected = rms_norm_ref(x, w, 1e-6, r, unit_offset=True)
    got = rms_norm(x.to(device), w.to(device), 1e-6, None if r is None else r.to(device), unit_offset=True)
    got, expected = (got, expected) if with_residual else ((got,), (expected,))
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == dtype
        torch.testing.assert_close(g.cpu(), e, **tol[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.float32, None])
def test_round_once_ref_matches_olmo_bitwise(dtype: torch.dtype, weight_dtype: torch.dtype | None) -> None:
    torch.manual_seed(6)
    hf = Olmo2RMSNorm(48, eps=1e-6).to(weight_dtype or dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
    x = torch.randn(6, 48, dtype=dtype) * 3
    with torch.no_grad():
        expected = hf(x)
    got = rms_norm_ref(x, hf.weight.detach(), 1e-6, round_once=True)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_once_triton_matches_ref(dtype: torch.dtype, device: str, force_triton: None, tol: dict) -> None:
    torch.manual_seed(7)
    x = torch.randn(9, 40, dtype=dtype) * 2
    w = torch.randn(40)
    expected = rms_norm_ref(x, w, 1e-6, round_once=True)
    got = rms_norm(x.to(device), w.to(device), 1e-6, round_once=True)
    assert got.dtype == expected.dtype == dtype
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])
