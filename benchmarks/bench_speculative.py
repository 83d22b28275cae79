"""Speculative decoding on the demo task: each drafter vs plain decoding, in one run.

Workloads (held-out demo problems, chat-formatted), each at batch 1, 8 and 64: at most
that many sequences in flight (`max_running_requests`):
- greedy: `max(batch, GREEDY_MIN)` problems (at batch 1 one after another);
- self-consistency: batch / 8 problems (at least one), 8 seeded samples each at T = 0.6,
  top_p 0.9 (at batch 1 the samples run one after another);
- tree search: batch / 8 problems (at least one), a beam search over solution lines
  (`TREE_ROUNDS` rounds; each path of the beam, `TREE_BEAM` of them, expanded with
  `TREE_EXPAND` seeded samples of its next line at T = 0.8, scored by the demo task's
  step verifier `demo.verify.step_value`; paths ending in an `Answer:` line stop);
- json extraction: `max(batch, GREEDY_MIN)` held-out extraction dialogues of the demo
  mixture (a text and a schema; the answer copies values from the text), each greedy under
  its schema (`json_schema`): constrained requests, whose drafts are cut to their grammar;
- json self-consistency: batch / 8 of those dialogues (at least one), 8 seeded samples
  each at T = 0.6 under the schema (at batch 1 one after another).
Every side runs on its own engine per batch size, warmed up
first; timed runs alternate sides
(off, ngram, radix, draft, then ngram, radix, draft, off, ...: each repeat starts one side
later) with the radix cache flushed before each, and each side's
median run is reported: wall time, target forward passes (extend + verification/decode
steps), mean tokens per request per pass, how many times the tokens kept lay on an
alternative path of a token tree (`alt`), and the ratios against off. Outputs are
checked equal to off's (greedy and seeded sampling are exact under speculation). The
draft side's draft model is the one shipped for the demo model (runtime/demo/draft,
`scripts/train_draft_model.py`).

    python benchmarks/bench_speculative.py                 # the embedded demo model
    python benchmarks/bench_speculative.py --repeats 5 --batches 1 8
    python benchmarks/bench_speculative.py --device cuda   # on a GPU (CUDA graphs on)
    python benchmarks/bench_speculative.py --sides radix radix-path  # token trees on and off
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from sprig.runtime import Engine
from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.demo.dialogue import stream
from sprig.runtime.demo.evaluate import prompts
from sprig.runtime.demo.extraction import make_extraction_dialogue
from sprig.runtime.demo.tasks import Problem, take
from sprig.runtime.demo.verify import is_answer, step_value

SIDES = (None, "ngram", "radix", "draft", "radix-path")  # radix-path: the radix drafter without token trees
TASKS = ("greedy", "self-consistency", "tree search", "json extraction", "json self-consistency")
TREE_ROUNDS, TREE_BEAM, TREE_EXPAND = 6, 2, 4
GREEDY_MIN = 8  # greedy problems at the smaller batch sizes: one problem is too short a run to time
DRAFT_MODEL_PATH = DEMO_MODEL_PATH.parent / "draft"


@dataclass
class Run:
    seconds: float
    passes: int
    accept_length: float
    alternatives: int  # alternative paths of token trees the kept tokens lay on
    outputs: list[list[int]]


def greedy(engine: Engine, texts: list[str], max_new: int) -> list[list[int]]:
    outs = engine.generate(texts, {"max_new_tokens": max_new, "temperature": 0})
    return [o["output_ids"] for o in outs]


def self_consistency(engine: Engine, texts: list[str], max_new: int) -> list[list[int]]:
    params = {"max_new_tokens": max_new, "temperature": 0.6, "top_p": 0.9, "n": 8, "sampling_seed": 1}
    return [o["output_ids"] for o in engine.generate(texts, params)]


def tree_search(engine: Engine, texts: list[str], questions: list[str], max_new: int) -> list[list[int]]:
    """Beam search over solution lines for each problem at once; every sampled line's ids."""
    beams: list[list[tuple[str, ...]]] = [[()] for _ in texts]
    every: list[list[int]] = []
    for round_ in range(TREE_ROUNDS):
        open_paths = [(i, path) for i, beam in enumerate(beams) for path in beam if not path or not is_answer(path[-1])]
        if not open_paths:
            break
        params = {"max_new_tokens": max_new, "temperature": 0.8, "n": TREE_EXPAND, "stop": "\n",
                  "sampling_seed": 1000 * round_}
        outs = engine.generate([texts[i] + "".join(f"{line}\n" for line in path) for i, path in open_paths], params)
        every += [o["output_ids"] for o in outs]
        children: list[list[tuple[str, ...]]] = [[p for p in beam if p and is_answer(p[-1])] for beam in beams]
        for j, (i, path) in enumerate(open_paths):
            children[i] += [(*path, o["text"].strip()) for o in outs[j * TREE_EXPAND : (j + 1) * TREE_EXPAND]]
        beams = [sorted(set(c), key=lambda p, q=questions[i]: (-step_value(q, p), p))[:TREE_BEAM]
                 for i, c in enumerate(children)]
    return every


def json_extraction(engine: Engine, extractions: list[tuple[str, dict]], max_new: int,
                    samples: dict | None = None) -> list[list[int]]:
    """Each extraction under its schema: greedy, or with `samples` (n, temperature, seed)."""
    params = [{"max_new_tokens": max_new, "temperature": 0, "json_schema": schema, **(samples or {})}
              for _, schema in extractions]
    return [o["output_ids"] for o in engine.generate([text for text, _ in extractions], params)]


def extraction_prompts(tokenizer, count: int) -> list[tuple[str, dict]]:
    """Held-out extraction dialogues: each prompt (chat-formatted up to the answer, without
    the leading `<s>`) and its schema."""
    bos = tokenizer.bos_token or ""
    out = []
    for d in itertools.islice(stream(make_extraction_dialogue, "heldout", 0, "json"), count):
        text = tokenizer.apply_chat_template(list(d.messages[:-1]), add_generation_prompt=True, tokenize=False)
        out.append((text[len(bos):] if bos and text.startswith(bos) else text, d.schema))
    return out


def workload(task: str, batch: int, texts: list[str], problems: list[Problem], extractions: list[tuple[str, dict]],
             max_new: int):
    """The task at `batch` as a function of the engine, returning every output's ids."""
    if task == "greedy":
        return lambda engine: greedy(engine, texts[: max(batch, GREEDY_MIN)], max_new)
    if task == "json extraction":
        return lambda engine: json_extraction(engine, extractions[: max(batch, GREEDY_MIN)], max_new)
    count = max(1, batch // 8)
    if task == "json self-consistency":
        samples = {"n": 8, "temperature": 0.6, "top_p": 0.9, "sampling_seed": 1}
        return lambda engine: json_extraction(engine, extractions[:count], max_new, samples)
    if task == "self-consistency":
        return lambda engine: self_consistency(engine, texts[:count], max_new)
    return lambda engine: tree_search(engine, texts[:count], [p.question for p in problems[:count]], max_new // 2)


def timed(engine: Engine, run) -> Run:
    engine.flush_cache()
    sched = engine.scheduler
    passes0 = sched.stats.extend_steps + sched.stats.decode_steps
    spec = sched.speculative.stats if sched.speculative else None
    emitted0, steps0, alt0 = (spec.emitted, spec.request_steps, spec.alternatives_kept) if spec else (0, 0, 0)
    start = time.perf_counter()
    outputs = run(engine)
    seconds = time.perf_counter() - start
    passes = sched.stats.extend_steps + sched.stats.decode_steps - passes0
    accept = (spec.emitted - emitted0) / max(1, spec.request_steps - steps0) if spec else 1.0
    return Run(seconds, passes, accept, spec.alternatives_kept - alt0 if spec else 0, outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="the target's and the draft's weights and KV")
    ap.add_argument("--max-total-tokens", type=int, default=16384,
                    help="each engine's KV pool (the CPU default; every side and batch size has its own engine)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--disable-jump-forward", action="store_true",
                    help="every engine samples forced text token by token (the JSON tasks' keys and punctuation)")
    ap.add_argument("--sides", nargs="+", default=["off", *SIDES[1:4]], choices=["off", *SIDES[1:]],
                    help="drafters to run beside off (radix-path: radix without token trees)")
    args = ap.parse_args()
    sides = tuple(None if s == "off" else s for s in dict.fromkeys(["off", *args.sides]))
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {
        (side, batch): Engine(dtype=args.dtype, device=args.device, max_total_tokens=args.max_total_tokens,
                              speculative_algorithm="radix" if side == "radix-path" else side,
                              speculative_alternatives=0 if side == "radix-path" else 3, max_running_requests=batch,
                              speculative_num_draft_tokens=args.num_draft_tokens,
                              enable_jump_forward=not args.disable_jump_forward,
                              speculative_draft_model_path=str(DRAFT_MODEL_PATH) if side == "draft" else None)
        for side in sides for batch in args.batches
    }
    tokenizer = engines[None, args.batches[0]].tokenizer
    problems = take("heldout", max(*args.batches, GREEDY_MIN), seed=0)
    texts = prompts(tokenizer, problems)
    extractions = extraction_prompts(tokenizer, max(*args.batches, GREEDY_MIN))
    for engine in engines.values():  # warm-up
        engine.generate(texts[:2], {"max_new_tokens": 8, "temperature": 0})
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    print(f"demo model, {args.dtype}, {args.device} ({where}), {args.repeats} interleaved repeats, medians; "
          f"--num-draft-tokens {args.num_draft_tokens}{', jump-forward off' if args.disable_jump_forward else ''}")
    print(f"{'task':<22}{'batch':>6} {'side':<11}{'wall s':>9}{'passes':>8}{'tok/pass':>9}{'alt':>6}{'passes x':>9}"
          f"{'wall x':>8}")
    for task in args.tasks:
        for batch in args.batches:
            run = workload(task, batch, texts, problems, extractions, args.max_new_tokens)
            runs: dict[str | None, list[Run]] = {side: [] for side in sides}
            for repeat in range(args.repeats):  # each repeat in another order: none always runs after the same side
                for side in sides[repeat % len(sides):] + sides[: repeat % len(sides)]:
                    runs[side].append(timed(engines[side, batch], run))
            base = runs[None][0].outputs
            for side in sides:
                if any(r.outputs != base for r in runs[side]):
                    raise AssertionError(f"{task} batch {batch}: {side} changed the outputs")
            off_s = statistics.median(r.seconds for r in runs[None])
            off_p = statistics.median(r.passes for r in runs[None])
            for side in sides:
                s = statistics.median(r.seconds for r in runs[side])
                p = statistics.median(r.passes for r in runs[side])
                a = statistics.median(r.accept_length for r in runs[side])
                alt = statistics.median(r.alternatives for r in runs[side])
                print(f"{task:<22}{batch:>6} {side or 'off':<11}{s:>9.2f}{p:>8.0f}{a:>9.2f}{alt:>6.0f}{off_p / p:>9.2f}"
                      f"{off_s / s:>8.2f}", flush=True)
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
