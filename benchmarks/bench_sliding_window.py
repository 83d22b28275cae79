"""What a sliding window saves, or costs, on long contexts: the same weights served as a
Mistral checkpoint without a window (the baseline) and with a window of `--window` tokens in
every layer, each decoding `--new-tokens` tokens for `--batch` prompts of `--prompt-tokens`
tokens (longer than the window). Prefill and decode are timed apart (a first run of one new
token is the prefill; the decode time is the rest). The two engines alternate, `--repeats`
timed runs each, radix cache flushed before each; medians are reported with the windowed
run's ratio to the baseline's. On the CPU a third engine runs the windowed checkpoint on the
plain `reference` attention backend (one masked call per request, where the CPU backend
takes a long windowed prompt's queries in blocks, each over the slots its window reaches).
The checkpoints are links to one set of weights with edited config.json files, in a
temporary directory.

    python benchmarks/bench_sliding_window.py                      # the demo model, on the CPU
    python benchmarks/bench_sliding_window.py --window 64 --prompt-tokens 960
    python benchmarks/bench_sliding_window.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sprig.runtime import Engine
from sprig.runtime.demo import ensure_demo_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local Llama or Mistral checkpoint (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=896)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def as_mistral(base: Path, out: Path, window: int | None) -> Path:
    """`base`'s weights and tokenizer (linked) under a Mistral config.json with `window`."""
    out.mkdir()
    for f in base.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((base / "config.json").read_text())
    if config["architectures"][0] not in ("LlamaForCausalLM", "MistralForCausalLM") or config.get("attention_bias"):
        raise SystemExit(f"{base}: a Llama or Mistral checkpoint without attention biases is needed")
    config |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}
    (out / "config.json").write_text(json.dumps(config))
    return out


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    engine.flush_cache()
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new_tokens, "temperature": 0,
                                                        "ignore_eos": True})
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(args.model) if args.model else ensure_demo_model()
    if args.prompt_tokens <= args.window:
        raise SystemExit("--prompt-tokens must exceed --window, or the window hides nothing")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = [[(7 + 31 * i + 17 * j) % (vocab - 10) + 10 for j in range(args.prompt_tokens)] for i in range(args.batch)]
    options = dict(device=args.device, dtype=args.dtype, context_length=args.prompt_tokens + args.new_tokens + 1,
                   max_running_requests=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        windowed = str(as_mistral(base, Path(tmp) / "window", args.window))
        engines = {"full attention (baseline)": Engine(str(as_mistral(base, Path(tmp) / "full", None)), **options),
                   f"window {args.window}": Engine(windowed, **options)}
        if args.device == "cpu":
            engines[f"window {args.window}, reference"] = Engine(windowed, attention_backend="reference", **options)
        prefill: dict[str, list[float]] = {name: [] for name in engines}
        decode: dict[str, list[float]] = {name: [] for name in engines}
        try:
            for engine in engines.values():  # warm-up
                timed(engine, prompts[:1], 2)
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    first = timed(engine, prompts, 1)
                    prefill[name].append(first)
                    decode[name].append(timed(engine, prompts, args.new_tokens + 1) - first)
        finally:
            for engine in engines.values():
                engine.shutdown()
    baseline = next(iter(engines))
    print(f"{base.name}: {args.batch} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each, "
          f"{args.device} {args.dtype}, median of {args.repeats}")
    for phase, times in (("prefill", prefill), ("decode", decode)):
        base_median = statistics.median(times[baseline])
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {phase:7s} {name:30s} {median:7.3f} s   {median / base_median:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
