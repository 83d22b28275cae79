"""What a reinforcement-learning loop pays to serve rollouts from new weights: loading a
checkpoint into the running engine or server (`update_weights_from_disk`) against what a
loop without it does, starting a new one on that checkpoint (a fresh `Engine`; a fresh
`sprig serve`, until it logs that it is ready).

The checkpoint is the model after a stand-in 'training step' (seeded noise on every
weight), saved next to it by transformers; the two sides alternate, `--repeats` timed runs
each, and each side's median is reported with its ratio to the update's. After each update
the engine's greedy answer is checked against a fresh engine's on the same checkpoint.

    python benchmarks/bench_weight_update.py                  # the demo model, on the CPU
    python benchmarks/bench_weight_update.py --repeats 5 --no-server
    python benchmarks/bench_weight_update.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sprig.runtime import Engine
from sprig.runtime.demo import ensure_demo_model

PROMPT = "Ava has 3 apples and buys 4 more. How many apples does Ava have now?"
GREEDY = {"max_new_tokens": 16, "temperature": 0}
READY = re.compile(r"ready at (http://\S+)")


def stepped_copy(path: Path, out: Path) -> Path:
    """The model at `path` after a stand-in training step, saved at `out` with its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01 * p.std())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def restart_engine(path: Path, common: dict) -> None:
    Engine(str(path), **common).shutdown()


def post_update(url: str, path: Path) -> None:
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(path)}, timeout=600)
    r.raise_for_status()


def start_server(path: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, Path]:
    log = Path(tempfile.mkstemp(prefix="bench-weight-update-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "sprig.runtime", "serve", "--model", str(path), "--port", "0",
           "--device", args.device, "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while not (match := READY.search(log.read_text())):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()}")
        time.sleep(0.02)
    return proc, match.group(1), log


def stop_server(proc: subprocess.Popen, log: Path) -> None:
    proc.terminate()
    proc.wait(60)
    log.unlink()


def report(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(next(iter(times.values())))
    print(title)
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<44} {med:8.3f} s  ({med / base:.1f}x)   runs: {', '.join(f'{t:.3f}' for t in ts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side, interleaved")
    parser.add_argument("--no-server", action="store_true", help="time the offline engine only")
    args = parser.parse_args()

    model = Path(args.model) if args.model else ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="bench-weight-update-") as tmp:
        stepped = stepped_copy(model, Path(tmp) / "stepped")
        paths = [stepped, model]
        common = dict(device=args.device, dtype=args.dtype)
        answers = {}
        for p in paths:
            with Engine(str(p), **common) as fresh:
                answers[p] = fresh.generate(PROMPT, GREEDY)["output_ids"]
        assert answers[stepped] != answers[model], "the stand-in step changed nothing the check would see"
        print(f"{model.name}: {sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters()):,} "
              f"weights, {args.dtype} on {args.device}")

        times: dict[str, list[float]] = {"Engine.update_weights_from_disk": [], "a new Engine on the checkpoint": []}
        with Engine(str(model), **common) as engine:
            for i in range(args.repeats):
                path = paths[i % 2]
                times["Engine.update_weights_from_disk"].append(timed(engine.update_weights_from_disk, str(path)))
                assert engine.generate(PROMPT, GREEDY)["output_ids"] == answers[path]
                times["a new Engine on the checkpoint"].append(timed(restart_engine, path, common))
        report("offline engine:", times)

        if args.no_server:
            return
        times = {"POST /update_weights_from_disk": [], "a new sprig serve, until it is ready": []}
        proc, url, log = start_server(model, args)
        try:
            for i in range(args.repeats):
                path = paths[i % 2]
                times["POST /update_weights_from_disk"].append(timed(post_update, url, path))
                out = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": GREEDY}, timeout=60).json()
                assert out["output_ids"] == answers[path]
                start = time.perf_counter()
                other, _, other_log = start_server(path, args)
                times["a new sprig serve, until it is ready"].append(time.perf_counter() - start)
                stop_server(other, other_log)
        finally:
            stop_server(proc, log)
        report("server:", times)


if __name__ == "__main__":
    main()
