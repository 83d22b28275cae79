"""Benchmark the mixture-of-experts experts on a GPU: the Triton path (padded per-expert
blocks, no host sync: what CUDA graphs capture) against the torch reference (one matmul
pair per expert that has tokens, group sizes read on the host), same shapes, same run.

Also prints the weight bytes each call must read at least (every expert some token picked,
once) over the time, beside the measured device-to-device copy bandwidth: at small token
counts the experts are bandwidth-bound, so that ratio is how close the kernel comes.
Outputs of both paths are compared first. Times are CUDA-event medians after warmup.
Default shapes are one Qwen3-30B-A3B layer (128 experts, 8 per token, hidden 2048,
expert intermediate 768), bfloat16.

    python benchmarks/bench_moe.py
    python benchmarks/bench_moe.py --tokens 1 64 --experts 8 --top-k 2 --hidden 4096 --inter 14336
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_kernels import copy_bandwidth_gbs, time_ms

from sprig.kernels.moe import fused_experts_ref, fused_experts_triton, route_topk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096], help="tokens per call")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA device (on the CPU the experts take the torch path only)", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    E, K, H, inter = args.experts, args.top_k, args.hidden, args.inter
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=gen) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, device="cuda", generator=gen) / inter**0.5).to(dtype)
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    peak = copy_bandwidth_gbs(args)
    print(f"{torch.cuda.get_device_name()}: {E} experts, top {K}, hidden {H}, intermediate {inter}, {args.dtype}; "
          f"copy bandwidth {peak:.0f} GB/s\n")
    print("| tokens | experts used | torch ms | triton ms | speedup | triton weight GB/s | of copy bw |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in args.tokens:
        x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
        weights, ids = route_topk(torch.randn(T, E, device="cuda", generator=gen), K, renormalize=True)
        want, got = fused_experts_ref(x, w13, w2, weights, ids), fused_experts_triton(x, w13, w2, weights, ids)
        worst = float((want.float() - got.float()).abs().max())
        scale = float(want.float().abs().max()) or 1.0
        if worst > 0.05 * scale:
            print(f"MISMATCH at {T} tokens: the paths differ by {worst:.3g} (largest output {scale:.3g})")
            return 1
        ref_ms = time_ms(lambda: fused_experts_ref(x, w13, w2, weights, ids), args.warmup, args.reps)  # noqa: B023
        tri_ms = time_ms(lambda: fused_experts_triton(x, w13, w2, weights, ids), args.warmup, args.reps)  # noqa: B023
        used = int(torch.unique(ids).numel())
        gbs = used * expert_bytes / (tri_ms * 1e-3) / 1e9
        print(f"| {T} | {used} | {ref_ms:.3f} | {tri_ms:.3f} | {ref_ms / tri_ms:.2f}x | {gbs:.0f} | {gbs / peak:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
