"""Quantized weights: decode throughput and memory against float32 in one run, and the
demo model's greedy accuracy at each precision.

Speed (the default): a random Llama built here, large enough that reading the weights
dominates a decode step on a CPU (--size 300m: 18 layers, hidden 1024, about 270M
parameters), run as float32, bfloat16, int8 (per output channel), int4 (groups of
128) and fp8 e4m3 (per output channel, dequantized for each matmul), the quantized ones
with bfloat16 activations (torch's CPU int8/int4 kernels are
vectorised for bfloat16; with float32 activations they take a scalar path). `--threads`
sets torch's threads (default 1: on a CPU shared with other processes, torch's int8/int4
kernels with two threads spent about 8 ms a call waiting at OpenMP barriers, whatever the
layer's size; one thread ran them in 0.1-0.5 ms). Each repeat
prefills `--batch` prompts and times `--steps` decode steps of the model runner (the
model's forward and the greedy pick; no scheduler), for every precision in turn, so that
a slow phase of a shared machine lands on all alike; medians are reported. Printed: weight
bytes, KV bytes per token, decode tokens/s at each batch size, and each ratio to float32.

Accuracy (--accuracy): the shipped demo model on the 200 held-out problems, greedy, in
float32 and with int8, int4 and fp8 weights (float32 activations, so only the weights
differ; and int4 beside the int8 KV cache), through the offline Engine.

    python benchmarks/bench_quant.py                      # speed, batch 1 and 32
    python benchmarks/bench_quant.py --repeats 5 --steps 32 --threads 2
    python benchmarks/bench_quant.py --accuracy
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.quantization.linear import QuantizedLinear
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

SIZES = {  # random Llama shapes (--size)
    "300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=18,
                 num_attention_heads=16, num_key_value_heads=4),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
}
PRECISIONS = {  # name -> RunnerConfig options
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="bfloat16", quantization="int8"),
    "int4": dict(dtype="bfloat16", quantization="int4", quantization_group_size=128),
    "fp8": dict(dtype="bfloat16", quantization="fp8"),
}
ACCURACY = {  # name -> Engine options for the demo model (groups of 32: its MLP is 672 wide)
    "float32": dict(dtype="float32"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4 g32": dict(dtype="float32", quantization="int4", quantization_group_size=32),
    "int4 g32, int8 KV cache": dict(dtype="float32", quantization="int4", quantization_group_size=32,
                                    kv_cache_dtype="int8"),
    "fp8": dict(dtype="float32", quantization="fp8"),
}


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters, plus the quantized layers' codes, scales and zero points."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model.modules():
        if isinstance(layer, QuantizedLinear):
            total += sum(b.numel() * b.element_size() for b in layer.buffers())
    return total


def decode_rate(runner: ModelRunner, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Prefill `batch` random prompts, then time `steps` decode steps: tokens/s."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    span = prompt_len + steps
    base = runner.kv_cache.page_size
    contexts = [torch.arange(base + b * span, base + b * span + prompt_len, dtype=torch.int32) for b in range(batch)]
    ids = torch.randint(4, vocab, (batch * prompt_len,), generator=g).tolist()
    step = ForwardStep(ForwardMode.EXTEND, ids, [prompt_len] * batch, [prompt_len] * batch,
                     torch.cat(contexts), [prompt_len - 1] * batch)
    next_ids = runner.forward(step).argmax(-1).tolist()
    elapsed = 0.0
    for i in range(steps):
        contexts = [torch.cat([c, c[-1:] + 1]) for c in contexts]
        step = ForwardStep(ForwardMode.DECODE, next_ids, [1] * batch, [prompt_len + i + 1] * batch,
                         torch.cat(contexts), [0] * batch)
        start = time.perf_counter()
        next_ids = runner.forward(step).argmax(-1).tolist()
        elapsed += time.perf_counter() - start
    return batch * steps / elapsed


def speed(args: argparse.Namespace) -> None:
    tmp = tempfile.TemporaryDirectory(prefix="sprig-bench-quant-")
    started = time.monotonic()
    path = build_tiny_checkpoint(Path(tmp.name) / args.size, "llama", seed=0, **SIZES[args.size])
    batches = sorted(set(args.batch))
    tokens = max(batches) * (args.prompt_len + args.steps) + 16
    runners = {
        name: ModelRunner(RunnerConfig(path, device="cpu", max_total_tokens=tokens, cpu_threads=args.threads,
                                       **options))
        for name, options in PRECISIONS.items()
    }
    params = sum(p.numel() for p in runners["float32"].model.parameters())
    print(f"random llama {args.size}: {params / 1e6:.0f}M parameters, built and loaded {len(PRECISIONS)} ways in "
          f"{time.monotonic() - started:.0f} s; torch threads {torch.get_num_threads()}")
    for runner in runners.values():  # warm-up
        decode_rate(runner, 1, args.prompt_len, 2, seed=0)
    rates: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.repeats):
        for batch in batches:
            for name, runner in runners.items():
                rates.setdefault((name, batch), []).append(
                    decode_rate(runner, batch, args.prompt_len, args.steps, seed=rep)
                )
    base = {b: statistics.median(rates[("float32", b)]) for b in batches}
    f32_bytes = weight_bytes(runners["float32"].model)
    header = ["precision", "weight MB", "float32 / this", "KV B/token"]
    header += [h for b in batches for h in (f"decode tok/s bs={b}", "x float32")]
    print(f"\n{args.repeats} repeats of {args.steps} decode steps after a {args.prompt_len}-token prompt; medians")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(header))) + "|")
    for name, runner in runners.items():
        wb = weight_bytes(runner.model)
        row = [name, f"{wb / 2**20:,.0f}", f"{f32_bytes / wb:.2f}x", f"{runner.kv_cache.shape.bytes_per_token:,}"]
        for b in batches:
            rate = statistics.median(rates[(name, b)])
            row += [f"{rate:,.1f}", f"{rate / base[b]:.2f}x"]
        print("| " + " | ".join(row) + " |")
    spread = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in rates.items()}
    print(f"\nrange of the repeats (tok/s): {spread}")
    tmp.cleanup()


def accuracy(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from sprig.runtime import Engine
    from sprig.runtime.demo import ensure_demo_model, tasks
    from sprig.runtime.demo.evaluate import prompts

    path = ensure_demo_model()
    problems = tasks.take("heldout", args.problems)
    texts = prompts(AutoTokenizer.from_pretrained(path), problems)
    print(f"demo model, {len(problems)} held-out problems, greedy, max_new_tokens 128")
    print("| weights | accuracy | vs float32 |")
    print("| --- | ---: | ---: |")
    base = None
    for name, options in ACCURACY.items():
        with Engine(str(path), **options) as engine:
            outs = engine.generate(texts, {"max_new_tokens": 128, "temperature": 0})
        right = sum(tasks.extract_answer(o["text"]) == p.answer for o, p in zip(outs, problems, strict=True))
        acc = 100 * right / len(problems)
        base = acc if base is None else base
        print(f"| {name} | {acc:.1f}% | {acc - base:+.1f} points |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true", help="the demo model's accuracy instead of speed")
    parser.add_argument("--size", choices=sorted(SIZES), default="300m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (speed)")
    parser.add_argument("--problems", type=int, default=200, help="held-out problems (--accuracy)")
    args = parser.parse_args()
    accuracy(args) if args.accuracy else speed(args)


if __name__ == "__main__":
    main()
