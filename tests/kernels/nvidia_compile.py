"""Compile the Triton kernels for NVIDIA GPUs on a machine without one (run as a script,
never under `TRITON_INTERPRET`): each launcher runs on small CPU tensors with the kernel
launch recorded instead of run, and each distinct launch (argument types and constexpr
values) is compiled to machine code for the given compute capabilities by Triton's own
compiler and its bundled ptxas.

The interpreter runs Python: it accepts code that compiled Triton refuses (a constexpr
branch returning another type than the code after it, a non-constexpr block size, ...),
so this is what checks, without a GPU, that the GPU path builds at all. It checks no
values (the interpreter's tests do that) and no performance.

Usage: python nvidia_compile.py [--dtypes NAME,...] CAPABILITY [CAPABILITY ...]
e.g. `80 90` (every activation dtype: a few minutes), `--dtypes bfloat16 90` (CI's).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "compile checks need Triton's compiler, not its interpreter"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from sprig.kernels.activation import act_and_mul_triton  # noqa: E402
from sprig.kernels.decode_attention import decode_attention_triton  # noqa: E402
from sprig.kernels.extend_attention import extend_attention_triton  # noqa: E402
from sprig.kernels.kv_quant import quantize_kv_ref  # noqa: E402
from sprig.kernels.logit_mask import apply_token_bitmask_triton  # noqa: E402
from sprig.kernels.moe import ClampedSwiGLU, fused_experts_triton  # noqa: E402
from sprig.kernels.mxfp4 import Mxfp4Weight, quantize_mxfp4  # noqa: E402
from sprig.kernels.quant_matmul import quant_matmul_triton  # noqa: E402
from sprig.kernels.rmsnorm import rms_norm_triton  # noqa: E402
from sprig.kernels.rotary import apply_rotary_triton, rope_cos_sin  # noqa: E402
from sprig.kernels.store_kv import store_kv_triton  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
         torch.float8_e4m3fn: "fp8e4nv"}
Launch = tuple[JITFunction, tuple[Any, ...], dict[str, Any]]


def recorded_launches(calls: Callable[[], None]) -> list[Launch]:
    """Every kernel launch `calls()` makes, recorded instead of run."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        calls()
    finally:
        JITFunction.run = original
    return launches


def signature(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, str], dict]:
    """Triton's signature of a launch: a pointer type per tensor, i32/i64 per int, fp32 per
    float, and the constexpr values."""
    values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
    types: dict[str, str] = {}
    constants: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        value = values[name]
        if i in fn.constexprs or value is None:
            types[name] = "constexpr"
            constants[(i,)] = value
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            types[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return types, constants


def launch_everything(capability: int, dtypes: list[torch.dtype]) -> None:
    """The launchers of every kernel, in each variant the runtime uses on a GPU of compute
    `capability` (float8 KV pools from 8.9, as `ModelRunner` allows them), for activations
    in `dtypes`."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    for dtype in dtypes:
        x = randn(5, 64, dtype=dtype)
        act_and_mul_triton(x, gelu=False)
        act_and_mul_triton(x, gelu=True)
        rms_norm_triton(x, randn(64), 1e-6)
        rms_norm_triton(x, randn(64), 1e-6, x.clone(), round_once=True)
        rms_norm_triton(x, randn(64), 1e-6, x.clone(), unit_offset=True)
        cos, sin = rope_cos_sin(16, 32, base=10_000.0, scaling=None, device=torch.device("cpu"), dtype=torch.float32)
        apply_rotary_triton(randn(5, 6, 16, dtype=dtype), torch.arange(5), cos, sin)
        apply_token_bitmask_triton(randn(3, 100, dtype=dtype), torch.zeros(3, 4, dtype=torch.int32))
        apply_token_bitmask_triton(randn(3, 100, dtype=dtype), torch.zeros(2, 4, dtype=torch.int32),
                                   rows=torch.tensor([0, 2]))
        for bits in (4, 8):
            quant_matmul_triton(x, torch.zeros(64 * bits // 8, 32, dtype=torch.uint8), randn(2, 32), randn(2, 32),
                                bits=bits)
        quant_matmul_triton(x, torch.zeros(64, 32, dtype=torch.uint8), randn(2, 32), randn(2, 32), bits=8, float8=True)
        _attention(dtype, randn, float8_pool=capability >= 89)
        _experts(dtype, randn)


def _attention(dtype: torch.dtype, randn: Callable[..., torch.Tensor], *, float8_pool: bool) -> None:
    """Store, extend and decode over float and quantized pools, with every option."""
    pool, hq, hkv, d = 40, 4, 2, 16
    qo, kv = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 10, 20], dtype=torch.int32)
    indices, sinks = torch.arange(1, 21, dtype=torch.int32), torch.zeros(hq)
    until = torch.tensor([9, 10, 17, 18, 19, 20])
    for storage in (None, torch.int8, *([torch.float8_e4m3fn] if float8_pool else [])):
        k, v = randn(pool, hkv, d, dtype=dtype), randn(pool, hkv, d, dtype=dtype)
        scales: dict[str, torch.Tensor] = {}
        if storage is not None:
            (k, ks), (v, vs) = quantize_kv_ref(k, storage), quantize_kv_ref(v, storage)
            scales = {"k_scale": ks, "v_scale": vs}
        new = randn(3, hkv, d, dtype=dtype)
        store_kv_triton(k, v, torch.tensor([3, 4, 5]), new, new, **scales)
        for options in ({}, {"window": 4}, {"softcap": 5.0}, {"sinks": sinks},
                        {"window": 4, "softcap": 5.0, "sinks": sinks}):
            for extra in ({}, {"attend_until": until}):
                extend_attention_triton(randn(6, hq, d, dtype=dtype), k, v, qo, kv, indices, sm_scale=0.25,
                                        max_q_len=4, **scales, **options, **extra)
            decode_attention_triton(randn(2, hq, d, dtype=dtype), k, v, kv, indices, sm_scale=0.25,
                                    num_kv_splits=4, **scales, **options)


def _experts(dtype: torch.dtype, randn: Callable[..., torch.Tensor]) -> None:
    """SwiGLU experts, and gpt-oss's: biases, the clamped SwiGLU, MXFP4 weights."""
    E, H, inter, T, K = 4, 64, 64, 5, 2
    x, ids, weights = randn(T, H, dtype=dtype), torch.randint(0, E, (T, K)), torch.rand(T, K)
    w13, w2 = randn(E, 2 * inter, H, dtype=dtype), randn(E, H, inter, dtype=dtype)
    fused_experts_triton(x, w13, w2, weights, ids)
    packed13, packed2 = Mxfp4Weight(*quantize_mxfp4(w13)), Mxfp4Weight(*quantize_mxfp4(w2))
    biases = {"b13": randn(E, 2 * inter, dtype=dtype), "b2": randn(E, H, dtype=dtype)}
    for a, b in ((w13, w2), (packed13, packed2), (packed13, w2)):
        fused_experts_triton(x, a, b, weights, ids, **biases, activation=ClampedSwiGLU(1.702, 7.0))


def main(capabilities: list[int], dtypes: list[torch.dtype]) -> None:
    kernels: set[str] = set()
    for capability in capabilities:
        distinct: dict[str, tuple[JITFunction, dict[str, str], dict]] = {}
        for fn, args, kwargs in recorded_launches(lambda c=capability: launch_everything(c, dtypes)):
            types, constants = signature(fn, args, kwargs)
            distinct.setdefault(f"{fn.__name__} {sorted(types.items())} {sorted(constants.items(), key=str)}",
                                (fn, types, constants))
        for fn, types, constants in distinct.values():
            try:
                triton.compile(ASTSource(fn, signature=types, constexprs=constants),
                               target=GPUTarget("cuda", capability, 32))
            except Exception as e:
                sys.exit(f"{fn.__name__} does not compile for sm_{capability} with {types} {constants}: {e}")
            kernels.add(fn.__name__)
        print(f"sm_{capability}: compiled {len(distinct)} launches")
    print(f"kernels: {', '.join(sorted(kernels))}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    names = ["float32", "bfloat16", "float16"]
    if argv[:1] == ["--dtypes"]:
        names, argv = argv[1].split(","), argv[2:]
    main([int(c) for c in argv], [getattr(torch, name) for name in names])
