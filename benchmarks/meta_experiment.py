"""The meta-generation experiment: accuracy bought with tokens, and what the radix cache saves.

On held-out problems of the demo task (multi-step arithmetic, `sprig.runtime.demo`) it runs

- greedy decoding;
- best-of-N (highest mean logprob) and self-consistency (majority vote) for N = 1, 2, 4, ...;
- a step-wise beam search over solution lines (`sprig.meta.tree_search`) whose value
  function, the demo task's process verifier (`sprig.runtime.demo.verify`), checks that
  every `a op b = c` line holds and follows from the question and the lines before it;

each on a server with the radix cache ON and on one with it OFF
(`--disable-radix-cache`). Both servers run for the whole experiment and each strategy
runs on one, then at once on the other, so a machine whose speed drifts during the run
(a shared VM) skews the wall time ratio of a strategy little; an idle server uses no
CPU. Every strategy is a `sprig.meta` call that returns a `Cost` (prompt, cached and
generated tokens from the server's meta_info); many problems run at once (`--threads`)
so the server batches them. The prefix cache is flushed before each strategy, so a
strategy's cached tokens are its own reuse. Sampling is seeded per problem
(`--sample-seed`): best-of-N and self-consistency choose among the same samples, a
larger N adds samples to a smaller N's, and the two cache settings sample alike, so
differences in the table come from the strategy, not from sampling noise.

Writes `results.md`, `results.json` and `accuracy_vs_tokens.png` to `--out-dir`.

    python benchmarks/meta_experiment.py [--problems 200] [--max-n 16] [--threads 64]

The checked-in results are the default run (200 problems, N up to 16: ~75 samples per
problem per cache setting), about 20 minutes on an otherwise idle 2-core CPU VM; on a loaded machine
it takes much longer. Scale with `--problems` and `--max-n`.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

import sprig
from sprig.cost import Cost, total
from sprig.meta import best_of_n, self_consistency, tree_search
from sprig.runtime.demo import DEMO_MODEL_PATH
from sprig.runtime.demo.evaluate import prompts as chat_prompts
from sprig.runtime.demo.tasks import Problem, extract_answer, take
from sprig.runtime.demo.verify import is_answer, step_value

Solver = Callable[[str, int, Any], tuple[int | None, Cost]]  # (prompt, seed, backend) -> (answer, cost)
SEED_STRIDE = 1 << 20  # problem i samples with seeds from sample_seed + i * SEED_STRIDE on


@dataclass(frozen=True)
class Strategy:
    name: str  # "greedy", "best-of-N", "self-consistency", "tree search"
    n: int  # samples per problem (for tree search: expand x beam)
    solve: Solver

    @property
    def label(self) -> str:
        return self.name if self.name in ("greedy", "tree search") else f"{self.name} N={self.n}"


@dataclass(frozen=True)
class Row:
    """One strategy on one server over all problems."""

    strategy: str
    n: int
    cache: str  # "on" | "off"
    accuracy: float
    calls: int
    prompt_tokens: int
    cached_tokens: int
    computed_prompt_tokens: int  # prompt_tokens - cached_tokens: what prefill actually ran
    completion_tokens: int
    wall_s: float  # elapsed time of the whole strategy over all problems
    errors: int  # problems whose requests failed (counted wrong; see --request-timeout)

    @property
    def computed_tokens(self) -> int:
        return self.computed_prompt_tokens + self.completion_tokens


def strategies(max_n: int, max_tokens: int, temperature: float, top_p: float, expand: int,
               beam: int) -> list[Strategy]:
    def as_str(text: str) -> str | None:
        answer = extract_answer(text)
        return None if answer is None else str(answer)

    def greedy(prompt: str, seed: int, backend: Any) -> tuple[int | None, Cost]:
        state = _greedy.run(prompt=prompt, max_tokens=max_tokens, backend=backend)
        return extract_answer(state["answer"]), state.cost()

    def bon(n: int) -> Solver:
        def solve(prompt: str, seed: int, backend: Any) -> tuple[int | None, Cost]:
            r = best_of_n(prompt, n, backend=backend, max_tokens=max_tokens, temperature=temperature,
                          top_p=top_p, seed=seed)
            return extract_answer(r.answer), r.cost
        return solve

    def sc(n: int) -> Solver:
        def solve(prompt: str, seed: int, backend: Any) -> tuple[int | None, Cost]:
            r = self_consistency(prompt, n, extract=as_str, backend=backend, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p, seed=seed)
            return (None if r.answer is None else int(r.answer)), r.cost
        return solve

    def search(prompt: str, seed: int, backend: Any) -> tuple[int | None, Cost]:
        def value(steps: tuple[str, ...]) -> float:
            return step_value(prompt, steps)  # the prompt's only numbers are the question's

        r = tree_search(prompt, value, expand=expand, beam=beam, depth=10, is_final=lambda s: is_answer(s[-1]),
                        backend=backend, max_step_tokens=24, temperature=temperature, top_p=top_p, seed=seed)
        return extract_answer(r.answer), r.cost

    ns = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= max_n]
    return [
        Strategy("greedy", 1, greedy),
        *(Strategy("best-of-N", n, bon(n)) for n in ns),
        *(Strategy("self-consistency", n, sc(n)) for n in ns),
        Strategy("tree search", expand * beam, search),
    ]


@sprig.function
def _greedy(s, prompt: str, max_tokens: int) -> None:
    s += prompt
    s += sprig.gen("answer", max_tokens=max_tokens, temperature=0.0)


def run_strategy(strategy: Strategy, cache: str, problems: list[Problem], prompts: list[str],
                 sample_seed: int, endpoint: sprig.RuntimeEndpoint, threads: int, bar: tqdm) -> Row:
    endpoint.flush_cache()

    def one(i: int) -> tuple[bool | None, Cost]:
        try:
            answer, cost = strategy.solve(prompts[i], sample_seed + i * SEED_STRIDE, endpoint)
        except Exception as e:  # a lost request: count the problem wrong, report it
            tqdm.write(f"{strategy.label}, cache {cache}, problem {i}: {type(e).__name__}: {e}")
            return None, Cost()
        finally:
            bar.update()
        return answer == problems[i].answer, cost

    bar.set_postfix_str(f"cache {cache}: {strategy.label}")
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(one, range(len(problems))))
    wall = time.perf_counter() - start
    cost = total(c for _, c in results)
    return Row(strategy.name, strategy.n, cache, sum(ok is True for ok, _ in results) / len(problems), cost.calls,
               cost.prompt_tokens, cost.cached_tokens, cost.prompt_tokens - cost.cached_tokens,
               cost.completion_tokens, wall, sum(ok is None for ok, _ in results))


def markdown(rows: list[Row]) -> str:
    """One line per strategy: both cache settings side by side, and off/on ratios."""
    head = ("| strategy | N | acc on | acc off | generated on | prompt on (computed / cached) "
            "| prompt off (computed) | computed off/on | wall on s | wall off s | wall off/on | errors on/off |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    by_key = {(r.strategy, r.n, r.cache): r for r in rows}
    lines = []
    for r in rows:
        if r.cache != "on" or (r.strategy, r.n, "off") not in by_key:
            continue
        off = by_key[(r.strategy, r.n, "off")]
        lines.append(
            f"| {r.strategy} | {r.n} | {r.accuracy:.1%} | {off.accuracy:.1%} | {r.completion_tokens:,} "
            f"| {r.computed_prompt_tokens:,} / {r.cached_tokens:,} | {off.computed_prompt_tokens:,} "
            f"| {off.computed_tokens / max(r.computed_tokens, 1):.2f}x | {r.wall_s:.1f} | {off.wall_s:.1f} "
            f"| {off.wall_s / max(r.wall_s, 1e-9):.2f}x | {r.errors}/{off.errors} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    colors = {"greedy": "black", "best-of-N": "tab:blue", "self-consistency": "tab:orange", "tree search": "tab:green"}
    markers = {"greedy": "*", "best-of-N": "o", "self-consistency": "s", "tree search": "D"}
    for name, color in colors.items():
        for cache, style in (("on", "-"), ("off", ":")):
            pts = sorted((r.computed_tokens, r.accuracy, r.n) for r in rows if r.strategy == name and r.cache == cache)
            if not pts:
                continue
            xs, ys, _ = zip(*pts, strict=True)
            face = color if cache == "on" else "none"
            ax.plot(xs, ys, style, color=color, marker=markers[name], markerfacecolor=face, markersize=8,
                    label=f"{name}, cache {cache}")
            if name in ("best-of-N", "self-consistency") and cache == "on":
                for x, y, n in pts:
                    ax.annotate(f"N={n}", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("tokens computed (prompt tokens prefilled + tokens generated), all problems")
    ax.set_ylabel("accuracy")
    ax.set_title("Demo task: accuracy vs compute, radix cache on (filled) / off (hollow)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", type=int, default=200, help="held-out problems to solve (default: 200)")
    p.add_argument("--max-n", type=int, default=16, help="largest N for best-of-N and self-consistency; "
                   "N runs over the powers of two up to it (default: 16)")
    p.add_argument("--threads", type=int, default=64, help="problems in flight at once (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the problem draw (default: 0)")
    p.add_argument("--sample-seed", type=int, default=0,
                   help="seed of the sampling: problem i's samples use seeds from this + i * 2**20 on, "
                   "so best-of-N and self-consistency vote over the same samples, N=k's samples are "
                   "the first k of N=2k's, and cache on and off sample alike (default: 0)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default: 0.6)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling (default: 0.9)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per solution (default: 128)")
    p.add_argument("--expand", type=int, default=3, help="tree search: next steps sampled per path (default: 3)")
    p.add_argument("--beam", type=int, default=2, help="tree search: paths kept per round (default: 2)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds one HTTP request may take; a problem whose request fails counts wrong "
                   "and is reported in the errors column (default: 120)")
    p.add_argument("--cache", choices=["both", "on", "off"], default="both",
                   help="radix cache settings to run (default: both)")
    p.add_argument("--model", default=str(DEMO_MODEL_PATH), help="checkpoint (default: the demo model)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/meta"),
                   help="where results.md, results.json and the plot go (default: benchmarks/results/meta)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    problems = take("heldout", args.problems, args.seed)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(args.model), problems)
    plan = strategies(args.max_n, args.max_tokens, args.temperature, args.top_p, args.expand, args.beam)
    caches = ["on", "off"] if args.cache == "both" else [args.cache]
    rows: list[Row] = []
    start = time.perf_counter()
    bar = tqdm(total=len(plan) * len(problems) * len(caches), unit="problem", dynamic_ncols=True)
    with ExitStack() as stack:
        endpoints = {}
        for cache in caches:
            bar.set_postfix_str(f"starting server, cache {cache}")
            runtime = stack.enter_context(sprig.Runtime(args.model, disable_radix_cache=cache == "off"))
            endpoints[cache] = sprig.RuntimeEndpoint(runtime.url, timeout=args.request_timeout)
            stack.callback(endpoints[cache].close)
        for strategy in plan:
            for cache in caches:
                rows.append(run_strategy(strategy, cache, problems, prompts, args.sample_seed,
                                         endpoints[cache], args.threads, bar))
    bar.close()
    elapsed = time.perf_counter() - start

    args.out_dir.mkdir(parents=True, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    table = markdown(rows) if len(caches) == 2 else "\n".join(str(asdict(r)) for r in rows) + "\n"
    header = (f"`{command}` — {len(problems)} held-out problems (seed {args.seed}, sample seed "
              f"{args.sample_seed}), temperature "
              f"{args.temperature}, top_p {args.top_p}, max {args.max_tokens} tokens, tree search expand {args.expand} beam "
              f"{args.beam}; {platform.machine()}, {elapsed:.0f} s in all.\n\n")
    (args.out_dir / "results.md").write_text(header + table)
    (args.out_dir / "results.json").write_text(json.dumps(
        {"command": command, "args": {k: str(v) for k, v in vars(args).items()}, "elapsed_s": elapsed,
         "rows": [asdict(r) | {"computed_tokens": r.computed_tokens} for r in rows]}, indent=2))
    plot(rows, args.out_dir / "accuracy_vs_tokens.png")
    print(header + table)


if __name__ == "__main__":
    main()
