"""Tensor parallelism on the CPU (gloo): TP=2 against TP=1 on one random Llama, in one run.

1. correctness: the same greedy requests (prompt and output logprobs) on both; the share
   of output tokens that agree and the largest |logprob| difference;
2. throughput: a batch of requests decoded by each, runs interleaved (TP=1, TP=2, TP=1,
   ...), median output tokens/s and the ratio. On a 2-core machine this is not a speedup
   measurement: TP=1 gets both cores as threads, each TP=2 rank one, and every layer adds
   two all-reduces between processes.

    python benchmarks/bench_tp.py                       # 16 requests x 64 tokens, 3 repeats
    python benchmarks/bench_tp.py --tp-size 4 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sprig.runtime import Engine
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[10 + (i * 7919 + j * 104729) % (vocab - 10) for j in range(length + i)] for i in range(n)]


def correctness(engines: dict[int, Engine], batch: list[list[int]], new_tokens: int) -> None:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    outs = {tp: e.generate(input_ids=batch, sampling_params=params, return_logprob=True, logprob_start_len=0)
            for tp, e in engines.items()}
    (one, base), (tp, other) = outs.items()
    same = total = 0
    worst = 0.0
    for a, b in zip(base, other, strict=True):
        same += sum(x == y for x, y in zip(a["output_ids"], b["output_ids"], strict=True))
        total += len(a["output_ids"])
        for key in ("input_token_logprobs", "output_token_logprobs"):
            pairs = zip(a["meta_info"][key], b["meta_info"][key], strict=True)
            worst = max([worst, *(abs(x[0] - y[0]) for x, y in pairs if x[0] is not None)])
    print(f"1. correctness, TP={tp} vs TP={one}: {same}/{total} output tokens equal "
          f"({len(batch)} greedy requests x {new_tokens} tokens), max |logprob diff| {worst:.2e} "
          "(prompt and output tokens)")


def throughput(engines: dict[int, Engine], batch: list[list[int]], new_tokens: int, repeats: int) -> None:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    rates: dict[int, list[float]] = {tp: [] for tp in engines}
    for _ in range(repeats):
        for tp, engine in engines.items():
            engine.flush_cache()
            start = time.perf_counter()
            outs = engine.generate(input_ids=batch, sampling_params=params)
            rates[tp].append(sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start))
    (one, base), (tp, other) = ((k, statistics.median(v)) for k, v in rates.items())
    print(f"2. throughput ({len(batch)} requests x {new_tokens} tokens, median of {repeats} interleaved runs): "
          f"TP={one} {base:.1f} tok/s, TP={tp} {other:.1f} tok/s, TP={tp} / TP={one} = {other / base:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu-threads", type=int, default=2, help="torch threads of TP=1; each rank gets a share")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_checkpoint(Path(tmp) / "llama", "llama", **MODEL)
        common = dict(dtype="float32", device="cpu", max_total_tokens=8192)
        engines = {
            1: Engine(str(path), cpu_threads=args.cpu_threads, **common),
            args.tp_size: Engine(str(path), tp_size=args.tp_size,
                                 cpu_threads=max(1, args.cpu_threads // args.tp_size), **common),
        }
        try:
            params = sum(p.numel() for p in engines[1].runner.model.parameters())
            print(f"random Llama, {params / 1e6:.1f}M parameters ({MODEL}), float32, CPU")
            batch = prompts(args.requests, args.prompt_len, engines[1].runner.model_config.vocab_size)
            correctness(engines, batch, args.new_tokens)
            throughput(engines, batch, args.new_tokens, args.repeats)
        finally:
            for engine in engines.values():
                engine.shutdown()


if __name__ == "__main__":
    main()
