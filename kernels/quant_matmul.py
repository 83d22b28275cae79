"""Weight-only quantized matmul: `x @ W` with W `[K, N]` dequantized on the fly.

Layout (`pack_codes` writes it): codes of `bits` (4 or 8) bits packed along K into uint8
`qweight [K * bits / 8, N]`, the low nibble first (code k sits in byte k // (8 // bits) at
bit (k % (8 // bits)) * bits); float32 `scales` and `zeros` `[K / group, N]`:

    W[k, n] = (code[k, n] - zeros[k // group, n]) * scales[k // group, n]

or, with `float8` (8-bit codes holding float8 e4m3 bits; zeros unused), W[k, n] =
e4m3(code[k, n]) * scales[k // group, n]. The kernel decodes e4m3 from the bits with
integer arithmetic (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0 is
subnormal), exactly, so it needs no float8 hardware and runs under the interpreter.

The Triton kernel accumulates in float32 and returns x's dtype. Small batches (M <= 16)
take a split-K GEMV shape: the K loop is shared among `split_k` programs whose float32
partial sums are added in a fixed order, so the result is deterministic but may round
differently from the one-pass GEMM shape that larger batches take.
"""

from __future__ import annotations

import torch

from ._dispatch import dot_in_f32, use_triton
from ._triton import tl, triton

GEMV_MAX_M = 16  # batches up to this many rows take the split-K shape


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [K // (8 // BITS), N] uint8
    s_ptr,  # [K // GROUP, N] float32
    z_ptr,  # [K // GROUP, N] float32
    out_ptr,  # [SPLIT_K, M, N]: x's dtype when SPLIT_K == 1, else float32 partial sums
    M,
    N,
    K,
    stride_xm,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    FLOAT8: tl.constexpr,  # codes are float8 e4m3 bits; zeros are not read
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast tl.dot operands (the interpreter mis-multiplies bf16)
):
    """One program: a [BLOCK_M, BLOCK_N] tile of the output over every SPLIT_K-th K block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER_BYTE: tl.constexpr = 8 // BITS
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        rk = k0 + tl.arange(0, BLOCK_K)  # [BK]
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
        wmask = kmask[:, None] & nmask[None, :]
        byte = tl.load(q_ptr + (rk // PER_BYTE)[:, None].to(tl.int64) * N + rn[None, :],
                       mask=wmask, other=0)  # [BK, BN]
        code = (byte.to(tl.int32) >> ((rk % PER_BYTE) * BITS)[:, None]) & ((1 << BITS) - 1)
        g = (rk // GROUP)[:, None].to(tl.int64) * N + rn[None, :]
        scale = tl.load(s_ptr + g, mask=wmask, other=0.0)
        if FLOAT8:
            w = _e4m3(code) * scale  # [BK, BN]
        else:
            zero = tl.load(z_ptr + g, mask=wmask, other=0.0)
            w = (code.to(tl.float32) - zero) * scale  # [BK, BN]
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=PRECISION)
    out = out_ptr + pid_k * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _e4m3(code):
    """The float32 value of float8 e4m3 bits (int32 in 0 .. 255; NaN codes not handled)."""
    exponent = (code >> 3) & 15
    mantissa = (code & 7).to(tl.float32)
    power = ((tl.maximum(exponent, 1) + 120) << 23).to(tl.float32, bitcast=True)  # 2**(max(e, 1) - 7)
    magnitude = tl.where(exponent == 0, mantissa / 8.0, 1.0 + mantissa / 8.0) * power
    return tl.where((code >> 7) != 0, -magnitude, magnitude)


def default_split_k(m: int, n: int, k: int, sms: int, *, block_n: int, block_k: int) -> int:
    """K splits of the GEMV shape: about two programs per SM, at most one per K block."""
    if m > GEMV_MAX_M:
        return 1
    programs = triton.cdiv(n, block_n)
    return max(1, min(16, triton.cdiv(k, block_k), -(-2 * sms // programs)))


def quant_matmul_triton(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K * bits / 8, N] uint8
    scales: torch.Tensor,  # [K / group, N] float32
    zeros: torch.Tensor,  # [K / group, N] float32
    *,
    bits: int,
    float8: bool = False,
    split_k: int | None = None,
) -> torch.Tensor:  # [M, N], x's dtype
    """Triton launcher. `split_k` None: `default_split_k` (a function of the shapes)."""
    m, k = x.shape
    n = qweight.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    gemv = m <= GEMV_MAX_M
    block_m, block_n, block_k = (16, 64, 64) if gemv else (64, 64, 64)
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        split_k = default_split_k(m, n, k, sms, block_n=block_n, block_k=block_k)
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scales, zeros, part, m, n, k, x.stride(0),
        GROUP=k // scales.shape[0], BITS=bits, FLOAT8=float8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_F32=dot_in_f32(x.dtype), num_warps=4,
    )
    if split_k > 1:
        out.copy_(part.sum(0))
    return out


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:  # [K, N] -> [K * bits / 8, N] uint8
    """Pack codes (< 2**bits, K a multiple of 8 / bits) into the kernel's layout, row-major
    whatever the strides of `codes` (a transposed view is the usual input)."""
    per_byte = 8 // bits
    c = codes.to(torch.uint8).contiguous().reshape(codes.shape[0] // per_byte, per_byte, codes.shape[1])
    out = torch.zeros_like(c[:, 0])
    for i in range(per_byte):
        out |= c[:, i] << (i * bits)
    return out


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:  # [K * bits / 8, N] -> [K, N] uint8
    """Inverse of `pack_codes`."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(qweight >> (i * bits)) & mask for i in range(per_byte)]
    return torch.stack(parts, 1).reshape(qweight.shape[0] * per_byte, qweight.shape[1])


def quant_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K * bits / 8, N] uint8
    scales: torch.Tensor,  # [K / group, N] float32
    zeros: torch.Tensor,  # [K / group, N] float32
    *,
    bits: int,
    float8: bool = False,
) -> torch.Tensor:  # [M, N], x's dtype
    """Torch reference: dequantize W to float32, round it to x's dtype, then matmul."""
    codes = unpack_codes(qweight, bits)  # [K, N] uint8
    group = codes.shape[0] // scales.shape[0]
    if float8:
        w = codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(group, 0)
    else:
        w = (codes.float() - zeros.repeat_interleave(group, 0)) * scales.repeat_interleave(group, 0)
    return x @ w.to(x.dtype)


def quant_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K * bits / 8, N] uint8
    scales: torch.Tensor,  # [K / group, N] float32
    zeros: torch.Tensor,  # [K / group, N] float32
    *,
    bits: int,
    float8: bool = False,
) -> torch.Tensor:  # [M, N], x's dtype
    """`x @ W` for the packed quantized W described in the module docstring."""
    if float8 and bits != 8:
        raise ValueError("float8 codes are 8 bits")
    if use_triton(x, qweight):
        return quant_matmul_triton(x, qweight, scales, zeros, bits=bits, float8=float8)
    return quant_matmul_ref(x, qweight, scales, zeros, bits=bits, float8=float8)
