"""What serving LoRA adapters costs: one batch of greedy requests on an engine without
LoRA (the baseline), on a LoRA engine with every request on the base model, and on the same
engine with the requests spread over `--adapters` adapters (one masked matmul pair per
adapted layer, whatever the mix). The adapters are PEFT's (random, rank `--rank`, on every
projection), written to a temporary directory. The three runs alternate, `--repeats` timed
runs each, radix cache flushed before each; each median is reported with its ratio to the
baseline's. The base-model requests of the LoRA engine are checked to give the baseline's
tokens.

    python benchmarks/bench_lora.py                       # the demo model, on the CPU
    python benchmarks/bench_lora.py --batch 64 --adapters 8 --rank 16
    python benchmarks/bench_lora.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from sprig.runtime import Engine
from sprig.runtime.demo import ensure_demo_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Ava has 3 apples and buys 4 more. How many apples does Ava have now?",
           "Write a short sentence about the sea.", "List three colours.", "What is 12 plus 30?"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=16, help="requests per run")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4, help="adapters the mixed run spreads its requests over")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def write_adapters(base: Path, out: Path, n: int, rank: int) -> dict[str, str]:
    paths = {}
    for i in range(n):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                init_lora_weights=False))
        peft.save_pretrained(out / f"a{i}")
        paths[f"a{i}"] = str(out / f"a{i}")
    return paths


def run(engine: Engine, prompts: list[str], names: list[str | None], new_tokens: int) -> tuple[float, list[list[int]]]:
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
                           lora_path=names)
    return time.perf_counter() - start, [o["output_ids"] for o in outs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(args.model) if args.model else ensure_demo_model()
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.batch)]
    common = dict(device=args.device, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(base, Path(tmp), args.adapters, args.rank)
        names = list(adapters)
        mixed = [names[i % len(names)] for i in range(args.batch)]
        plain, lora = Engine(str(base), **common), Engine(str(base), **common, lora_paths=adapters)
        cases = {"no LoRA (baseline)": (plain, [None] * args.batch),
                 "LoRA engine, base requests": (lora, [None] * args.batch),
                 f"LoRA engine, {len(names)} adapters mixed": (lora, mixed)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        outputs: dict[str, list[list[int]]] = {}
        for engine, which in cases.values():  # warm-up
            run(engine, prompts[:2], which[:2], 2)
        for _ in range(args.repeats):
            for name, (engine, which) in cases.items():
                seconds, outputs[name] = run(engine, prompts, which, args.new_tokens)
                times[name].append(seconds)
        plain.shutdown()
        lora.shutdown()
    if outputs["LoRA engine, base requests"] != outputs["no LoRA (baseline)"]:
        print("MISMATCH: the LoRA engine's base-model requests differ from the engine without LoRA")
        return 1
    tokens = args.batch * args.new_tokens
    print(f"{args.model or 'the demo model'}, {args.device} {args.dtype}: {args.batch} requests x {args.new_tokens} tokens, rank {args.rank} "
          f"on {', '.join(TARGETS)}; median of {args.repeats}\n")
    print("| run | seconds | tokens/s | vs baseline |")
    print("| --- | ---: | ---: | ---: |")
    baseline = statistics.median(times["no LoRA (baseline)"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"| {name} | {median:.2f} | {tokens / median:.0f} | {baseline / median:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
