"""Generate with the offline engine and watch the radix cache reuse a shared prefix.

    python examples/generate.py                    # a tiny random model, built locally
    python examples/generate.py --model PATH       # any local Llama/Mistral/Qwen2/Qwen3 checkpoint

Without --model this builds a tiny Llama with random weights under ~/.cache/sprig (no
model hub needed): the pipeline is real, but the text it writes is noise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sprig.runtime import Engine
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

DEFAULT_MODEL = Path.home() / ".cache" / "sprig" / "tiny-random-llama"
SYSTEM = "You are a careful assistant. Think step by step, then answer. "
QUESTIONS = ["What is two plus three?", "Name a blue bird.", "Why is the sky blue?", "Count to five."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="local checkpoint directory")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    model = args.model
    if model is None:
        model = DEFAULT_MODEL
        if not (model / "config.json").exists():
            print(f"building a tiny random Llama at {model} (random weights: expect noise)")
            build_tiny_checkpoint(model, "llama")
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    prompts = [SYSTEM + q for q in QUESTIONS]
    with Engine(model) as engine:
        for round_ in ("cold cache", "warm cache"):
            outs = engine.generate(prompts, params)
            print(f"\n== {round_} ==")
            for q, out in zip(QUESTIONS, outs, strict=True):
                meta = out["meta_info"]
                print(f"{q!r} -> {out['text']!r}")
                print(
                    f"   prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache, "
                    f"{meta['completion_tokens']} generated, finish {meta['finish_reason']}"
                )
        stats = engine.scheduler.stats
        cache = engine.scheduler.kv.cache
        print(
            f"\nprompt tokens computed {stats.prefill_tokens}, reused {stats.cached_tokens}, "
            f"generated {stats.decode_tokens}; radix hit rate {cache.hit_rate:.0%}"
        )
        engine.check_integrity()


if __name__ == "__main__":
    main()
