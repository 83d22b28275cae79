"""Benchmark sprig's Triton attention kernels against PyTorch SDPA on the same GPU, same run.

Decode: achieved KV bandwidth (K and V bytes read / time) and its ratio to the measured
device-to-device copy bandwidth, beside SDPA over pre-gathered (contiguous, padding-free)
KV. Extend (prefill without a prefix): causal attention TFLOP/s beside SDPA(is_causal).
Times are CUDA-event medians after warmup. Prints markdown tables.

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --batches 1 16 --contexts 4096 --reps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from sprig.kernels.decode_attention import decode_attention_triton
from sprig.kernels.extend_attention import extend_attention_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256],
                   help="batch sizes (requests)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768],
                   help="context length of every request, in tokens")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--num-kv-splits", type=int, default=None,
                   help="decode split-KV factor (default: the kernel's choice for each shape)")
    p.add_argument("--shuffle", action="store_true",
                   help="scatter each context over random pool slots (default: contiguous)")
    p.add_argument("--max-extend-tokens", type=int, default=131072,
                   help="skip extend shapes with more new tokens than this (batch*context)")
    p.add_argument("--skip-extend", action="store_true", help="decode only")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    return p.parse_args(argv)


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(args: argparse.Namespace) -> float:
    """Device-to-device copy bandwidth (bytes read + written / time) of a 1 GiB tensor."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(partial(dst.copy_, src), args.warmup, args.reps)
    del src, dst
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def make_case(batch: int, ctx: int, args: argparse.Namespace, dtype: torch.dtype):
    hkv, d = args.num_kv_heads, args.head_dim
    slots = batch * ctx + 1  # slot 0 is padding, as in the pool
    k_buf = torch.randn(slots, hkv, d, dtype=dtype, device="cuda")
    v_buf = torch.randn(slots, hkv, d, dtype=dtype, device="cuda")
    order = torch.randperm(batch * ctx, device="cuda") if args.shuffle else \
        torch.arange(batch * ctx, device="cuda")
    kv_indices = (order + 1).to(torch.int32)  # [B*L]
    kv_indptr = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * ctx  # [B+1]
    idx = kv_indices.view(batch, ctx).long()
    k_dense = k_buf[idx].transpose(1, 2).contiguous()  # [B, Hkv, L, D] (baseline input)
    v_dense = v_buf[idx].transpose(1, 2).contiguous()
    return k_buf, v_buf, kv_indptr, kv_indices, k_dense, v_dense


def fits(batch: int, ctx: int, args: argparse.Namespace, dtype: torch.dtype,
         q_tokens: int = 0) -> bool:
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * batch * ctx * args.num_kv_heads * args.head_dim * elem
    qo = 2 * q_tokens * args.num_q_heads * args.head_dim * elem  # q and out
    free, _ = torch.cuda.mem_get_info()
    return (2 * kv + qo) * 1.15 < free  # the pool, the gathered baseline copy, q and out


def bench_decode(args: argparse.Namespace, dtype: torch.dtype, copy_gbs: float) -> None:
    hq, d = args.num_q_heads, args.head_dim
    scale = d**-0.5
    print(f"\n### decode (Hq={hq}, Hkv={args.num_kv_heads}, D={d}, {args.dtype}, "
          f"splits={args.num_kv_splits or 'auto'}; copy bandwidth {copy_gbs:.0f} GB/s)\n")
    print("| batch | context | triton ms | triton GB/s | of copy BW | sdpa ms | sdpa GB/s "
          "| of copy BW | sdpa/triton time |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for ctx in args.contexts:
            if not fits(batch, ctx, args, dtype):
                print(f"| {batch} | {ctx} | skipped: does not fit in memory | | | | | | |")
                continue
            k_buf, v_buf, indptr, indices, k_dense, v_dense = make_case(batch, ctx, args, dtype)
            q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
            out = torch.empty_like(q)
            q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
            t_tri = time_ms(partial(
                decode_attention_triton, q, k_buf, v_buf, indptr, indices, sm_scale=scale,
                num_kv_splits=args.num_kv_splits, out=out), args.warmup, args.reps)
            t_sdpa = time_ms(partial(
                F.scaled_dot_product_attention, q4, k_dense, v_dense, scale=scale,
                enable_gqa=True), args.warmup, args.reps)
            nbytes = 2 * k_dense.numel() * k_dense.element_size()
            bw_tri = nbytes / (t_tri * 1e-3) / 1e9
            bw_sdpa = nbytes / (t_sdpa * 1e-3) / 1e9
            print(f"| {batch} | {ctx} | {t_tri:.3f} | {bw_tri:.0f} | {bw_tri / copy_gbs:.2f} "
                  f"| {t_sdpa:.3f} | {bw_sdpa:.0f} | {bw_sdpa / copy_gbs:.2f} "
                  f"| {t_sdpa / t_tri:.2f} |")
            del k_buf, v_buf, k_dense, v_dense
            torch.cuda.empty_cache()


def bench_extend(args: argparse.Namespace, dtype: torch.dtype) -> None:
    hq, d = args.num_q_heads, args.head_dim
    scale = d**-0.5
    print(f"\n### extend, causal, no prefix (Hq={hq}, Hkv={args.num_kv_heads}, D={d}, "
          f"{args.dtype})\n")
    print("| batch | context | triton ms | triton TFLOP/s | sdpa ms | sdpa TFLOP/s "
          "| sdpa/triton time |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for ctx in args.contexts:
            if batch * ctx > args.max_extend_tokens or not fits(
                    batch, ctx, args, dtype, q_tokens=batch * ctx):
                print(f"| {batch} | {ctx} | skipped: over --max-extend-tokens or memory "
                      "| | | | |")
                continue
            k_buf, v_buf, indptr, indices, k_dense, v_dense = make_case(batch, ctx, args, dtype)
            q = torch.randn(batch * ctx, hq, d, dtype=dtype, device="cuda")  # [T, Hq, D]
            out = torch.empty_like(q)
            q4 = q.view(batch, ctx, hq, d).transpose(1, 2)  # [B, Hq, L, D]
            t_tri = time_ms(partial(
                extend_attention_triton, q, k_buf, v_buf, indptr, indptr, indices,
                sm_scale=scale, max_q_len=ctx, out=out), args.warmup, args.reps)
            t_sdpa = time_ms(partial(
                F.scaled_dot_product_attention, q4, k_dense, v_dense, scale=scale,
                is_causal=True, enable_gqa=True), args.warmup, args.reps)
            # QK^T and PV over the visible (causal) keys: 4 * D flops per (query, key, head)
            flops = 4 * d * hq * batch * ctx * (ctx + 1) / 2
            print(f"| {batch} | {ctx} | {t_tri:.3f} | {flops / t_tri / 1e9:.1f} "
                  f"| {t_sdpa:.3f} | {flops / t_sdpa / 1e9:.1f} | {t_sdpa / t_tri:.2f} |")
            del k_buf, v_buf, k_dense, v_dense, q, out
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the kernels' CPU path is the torch reference, nothing to compare here.",
              file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"command: {' '.join(sys.argv)}")
    copy_gbs = copy_bandwidth_gbs(args)
    bench_decode(args, dtype, copy_gbs)
    if not args.skip_extend:
        bench_extend(args, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
