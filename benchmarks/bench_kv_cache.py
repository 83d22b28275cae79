"""What the int8 KV cache (`--kv-cache-dtype int8`) buys and costs, in one run:

1. capacity: tokens a KV budget holds with float32, bfloat16 and int8 caches (scales
   included), for the demo model's shape and two larger Llama shapes;
2. logits: the largest |logit| difference between an int8 and a float32 cache on the tiny
   test checkpoints (one random prompt prefilled in two chunks, then decode steps, the
   same tokens fed to both), and how often the argmax agrees;
3. accuracy: the demo model's greedy accuracy on the held-out problems with the float32
   cache and with the int8 cache (runs alternate: float, int8, float, ...).

    python benchmarks/bench_kv_cache.py                  # 200 problems
    python benchmarks/bench_kv_cache.py --problems 50 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sprig.radix.kv_cache import KVShape, slots_for_budget
from sprig.runtime import Engine
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.tasks import extract_answer, take
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

SHAPES = {  # name -> (layers, KV heads, head dim)
    "demo model (6 x 8 x 32)": (6, 8, 32),
    "~300M Llama (24 x 16 x 64)": (24, 16, 64),
    "Llama-3-8B (32 x 8 x 128)": (32, 8, 128),
}
CACHES = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.bfloat16, torch.int8)}
TINY = {  # name -> (arch, config overrides): the checkpoints the test suite and fuzzer use
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-mqa-sharp": ("llama", {"seed": 3, "num_key_value_heads": 1, "initializer_range": 0.15}),
    "mistral-sharp": ("mistral", {"seed": 4, "initializer_range": 0.1}),
}


def capacity(budget_gib: float) -> None:
    print(f"\n1. tokens in a {budget_gib:g} GiB KV budget")
    print("| model shape (layers x KV heads x head dim) | float32 | bfloat16 | int8 | int8 / float32 | int8 / bfloat16 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (layers, heads, dim) in SHAPES.items():
        n = {c: slots_for_budget(int(budget_gib * 2**30), KVShape(layers, heads, dim, *CACHES[c])) for c in CACHES}
        print(f"| {name} | {n['float32']:,} | {n['bfloat16']:,} | {n['int8']:,} | "
              f"{n['int8'] / n['float32']:.2f}x | {n['int8'] / n['bfloat16']:.2f}x |")


def _step(mode: ForwardMode, ids: list[int], slots: torch.Tensor) -> ForwardStep:
    return ForwardStep(mode, ids, [len(ids)], [slots.numel()], slots, [0])


def _teacher_forced_logits(path: Path, kv_cache_dtype: str, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits of every position: `prefill` tokens in two chunks, then one decode step per token."""
    runner = ModelRunner(RunnerConfig(path, dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype,
                                      max_total_tokens=len(ids) + 8))
    slots = torch.arange(1, len(ids) + 1, dtype=torch.int32)
    half = prefill // 2
    rows = [runner.forward(_step(ForwardMode.EXTEND, ids[:half], slots[:half])),
            runner.forward(_step(ForwardMode.EXTEND, ids[half:prefill], slots[:prefill]))]
    for i in range(prefill, len(ids)):
        rows.append(runner.forward(_step(ForwardMode.DECODE, ids[i : i + 1], slots[: i + 1])))
    return torch.cat(rows)  # [len(ids), V]


def logits(prefill: int, decode: int) -> None:
    print(f"\n2. int8 vs float32 KV cache on the tiny checkpoints ({prefill} prompt tokens in two chunks, "
          f"then {decode} decode steps, teacher-forced)")
    print("| checkpoint | max abs logit diff | max abs logit | argmax agrees |")
    print("| --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as root:
        for name, (arch, overrides) in TINY.items():
            path = build_tiny_checkpoint(Path(root) / name, arch, **overrides)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(4, 500, (prefill + decode,), generator=g).tolist()
            ref = _teacher_forced_logits(path, "auto", ids, prefill)
            got = _teacher_forced_logits(path, "int8", ids, prefill)
            agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
            print(f"| {name} | {float((got - ref).abs().max()):.2e} | {float(ref.abs().max()):.2f} | {agree:.1%} |")


def accuracy(n_problems: int, repeats: int, cpu_threads: int | None) -> None:
    problems = take("heldout", n_problems, seed=0)
    params = {"max_new_tokens": 128, "temperature": 0}
    print(f"\n3. the demo model's greedy accuracy on {n_problems} held-out problems (all at once; "
          f"{repeats} alternating runs of each, median wall time)")
    results: dict[str, tuple[float, list[float], int]] = {}
    engines = {kd: Engine(None, kv_cache_dtype=kd, cpu_threads=cpu_threads) for kd in ("auto", "int8")}
    try:
        texts = prompts(engines["auto"].tokenizer, problems)
        for _ in range(repeats):
            for kd, engine in engines.items():
                engine.flush_cache()
                start = time.perf_counter()
                outs = engine.generate(texts, params)
                wall = time.perf_counter() - start
                right = sum(extract_answer(o["text"]) == p.answer for o, p in zip(outs, problems, strict=True))
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                acc, walls, _ = results.get(kd, (right / n_problems, [], tokens))
                assert acc == right / n_problems, "greedy outputs changed between runs"
                results[kd] = (acc, [*walls, wall], tokens)
        print("| KV cache | accuracy | generated tokens | wall s (median) | pool bytes per token |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for kd, (acc, walls, tokens) in results.items():
            per_token = engines[kd].runner.kv_cache.shape.bytes_per_token
            print(f"| {'float32' if kd == 'auto' else kd} | {acc:.1%} | {tokens:,} | {statistics.median(walls):.1f} | {per_token:,} |")
        diff = results["int8"][0] - results["auto"][0]
        ratio = statistics.median(results["auto"][1]) / statistics.median(results["int8"][1])
        print(f"int8 - float32 accuracy: {100 * diff:+.1f} points; float32 wall / int8 wall: {ratio:.2f}x")
    finally:
        for engine in engines.values():
            engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, default=200, help="held-out problems (default: 200)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each cache in the accuracy part (default: 2)")
    p.add_argument("--budget-gib", type=float, default=8.0, help="KV budget of the capacity table (default: 8)")
    p.add_argument("--prefill", type=int, default=96, help="prompt tokens of the logits comparison (default: 96)")
    p.add_argument("--decode", type=int, default=32, help="decode steps of the logits comparison (default: 32)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads of the accuracy part's engines (default: the engine's)")
    p.add_argument("--skip-logits", action="store_true", help="only the capacity and accuracy parts")
    args = p.parse_args()
    torch.manual_seed(0)
    capacity(args.budget_gib)
    if not args.skip_logits:
        logits(args.prefill, args.decode)
    accuracy(args.problems, args.repeats, args.cpu_threads)


if __name__ == "__main__":
    main()
