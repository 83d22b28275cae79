"""Offline throughput on a shared-prefix workload: sprig vs sprig without the radix cache
vs transformers' batched `generate`.

Workload (SGLang's generated-shared-prefix shape, scaled for a CPU): G groups x P prompts;
each group shares a system prompt of S tokens, each prompt adds a Q-token question, and
every request generates exactly O tokens. Prompts arrive shuffled. The default batch
sizes are each side's fastest on the 2-core CPU (benchmarks/RESULTS.md): sprig runs all
128 requests at once, transformers 64 at a time.

All sides are loaded and warmed up first; with `--repeats N` their timed runs then
alternate (sprig, sprig without the cache, transformers, sprig, ...), so that a slow
phase of a shared machine lands on every side alike, and each side's run of median time
is reported.

Printed for each run: wall time, output tokens/s, prompt tokens computed, and tokens run
through the model (prompt tokens computed + decode steps' tokens); then the ratios. The
least prompt computation possible is G*S + G*P*Q (each shared prefix once). The ratio of
tokens run through the model is what a throughput ratio would be if both sides spent the
same time per token: a run that beats it does each token's work faster, one below it
slower.

    python benchmarks/bench_offline.py                 # a small random checkpoint, built here
    python benchmarks/bench_offline.py --model PATH    # any local Llama-family checkpoint
    python benchmarks/bench_offline.py --device cuda --dtype bfloat16 --size 1b  # on a GPU
    python benchmarks/bench_offline.py --repeats 3     # each side 3 times; the median run
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from sprig.runtime import Engine
from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

SIZES = {  # random Llama shapes the benchmark can build (--size)
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
}
PAD = 0  # the id that left-pads transformers' batches (masked out)


@dataclass
class Result:
    name: str
    seconds: float
    output_tokens: int
    prompt_tokens_computed: int
    requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def model_tokens(self) -> int:
        """Tokens run through the model: prompts computed, then one per decode step
        (a request's first output token comes from its prompt's last position)."""
        return self.prompt_tokens_computed + self.output_tokens - self.requests


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    low = 8  # stay clear of the tiny tokenizer's special tokens

    def ids(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    prompts = []
    for _ in range(args.groups):
        system = ids(args.system_len)
        prompts += [system + ids(args.question_len) for _ in range(args.prompts_per_group)]
    rng.shuffle(prompts)
    return prompts


class SprigSide:
    """A loaded engine, warmed up on the workload's own shapes; `run()` times one pass from
    a cold cache."""

    def __init__(self, name: str, model: str, prompts: list[list[int]], args: argparse.Namespace, **options) -> None:
        self.name, self.prompts = name, prompts
        self.params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
        if args.device.startswith("cuda"):  # leave room for the other sides, loaded beside it
            options.setdefault("mem_fraction_static", 0.3)
        self.engine = Engine(
            model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
            disable_cuda_graph=args.disable_cuda_graph, max_running_requests=args.batch, **options
        )
        # On CUDA, Triton compiles a kernel variant per shape class on first use.
        self.engine.generate(input_ids=prompts, sampling_params={**self.params, "max_new_tokens": 2})

    def run(self) -> Result:
        self.engine.flush_cache()
        before = self.engine.scheduler.stats.prefill_tokens
        start = time.perf_counter()
        outs = self.engine.generate(input_ids=self.prompts, sampling_params=self.params)
        seconds = time.perf_counter() - start
        computed = self.engine.scheduler.stats.prefill_tokens - before
        return Result(self.name, seconds, sum(len(o["output_ids"]) for o in outs), computed, len(self.prompts))

    def close(self) -> None:
        self.engine.shutdown()


class TransformersSide:
    """The checkpoint in `transformers`, warmed up on one batch's shape; `run()` times
    batched, left-padded `generate` over every prompt."""

    name = "transformers generate"

    def __init__(self, model_path: str, prompts: list[list[int]], args: argparse.Namespace) -> None:
        self.prompts, self.args = prompts, args
        dtype = getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device).eval()
        self.model.generation_config.eos_token_id = None
        with torch.inference_mode():
            warm = torch.tensor(prompts[: args.hf_batch], device=args.device)
            self.model.generate(input_ids=warm, max_new_tokens=2, do_sample=False, pad_token_id=PAD)

    def run(self) -> Result:
        args = self.args
        computed = produced = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(self.prompts), args.hf_batch):
                chunk = self.prompts[i : i + args.hf_batch]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[PAD] * (width - len(p)) + p for p in chunk], device=args.device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=args.device)
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len, do_sample=False, pad_token_id=PAD,
                )
                computed += ids.numel()
                produced += (out.shape[1] - width) * len(chunk)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return Result(self.name, time.perf_counter() - start, produced, computed, len(self.prompts))

    def close(self) -> None:
        del self.model


def median_run(runs: list[Result]) -> Result:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: build a small random Llama)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small",
                        help="shape of the random Llama built when --model is not given")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both engines)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--attention-backend", default="auto", help="sprig's (auto: the device's default)")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="sprig decodes eagerly on CUDA")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128, help="sprig's max running requests")
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers' batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each side, interleaved; the run of median time is reported")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="sprig-bench-")
        build_tiny_checkpoint(model, "llama", max_position_embeddings=4096, **SIZES[args.size])
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    prompts = workload(args, vocab)
    minimum = args.groups * args.system_len + len(prompts) * args.question_len
    print(
        f"{len(prompts)} requests: {args.groups} groups x {args.prompts_per_group}, system {args.system_len} "
        f"+ question {args.question_len} tokens, {args.output_len} output tokens; "
        f"{args.size if args.model is None else args.model}, {args.dtype} on {args.device}, threads={torch.get_num_threads()}"
    )
    sides = [
        SprigSide("sprig", model, prompts, args),
        SprigSide("sprig, radix cache off", model, prompts, args, disable_radix_cache=True),
    ]
    if not args.skip_transformers:
        sides.append(TransformersSide(model, prompts, args))
    runs: list[list[Result]] = [[] for _ in sides]
    for _ in range(args.repeats):  # interleaved: every side sees the machine's same phases
        for side, side_runs in zip(sides, runs, strict=True):
            side_runs.append(side.run())
    for side in sides:
        side.close()
    results = [median_run(r) for r in runs]

    print("\n| run | wall s | output tok/s | prompt tokens computed | vs minimum | tokens through the model |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r.name} | {r.seconds:.1f} | {r.tokens_per_s:,.0f} | {r.prompt_tokens_computed:,} | "
            f"{r.prompt_tokens_computed / minimum:.3f}x | {r.model_tokens:,} |"
        )
    sprig = results[0]
    if args.repeats > 1:
        print(f"\nthe run of median time of {args.repeats} is shown; all durations (s):")
        for r in runs:
            print(f"  {r[0].name}: {', '.join(f'{x.seconds:.2f}' for x in r)}")
    print(f"\nminimum prompt tokens (each shared prefix once): {minimum:,}")
    for other in results[1:]:
        print(
            f"throughput sprig / {other.name}: {sprig.tokens_per_s / other.tokens_per_s:.2f}x "
            f"(tokens through the model {other.model_tokens / sprig.model_tokens:.2f}x)"
        )


if __name__ == "__main__":
    main()
