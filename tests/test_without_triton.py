"""Triton ships Linux wheels only (pyproject installs it on Linux alone): where it is
missing, sprig must import and run its CPU path. A subprocess whose imports of `triton`
fail as if it were not installed imports every sprig package, then generates with a CPU
`Engine`; the same generation with triton present must give the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTriton())
"""
GENERATE = """
import json, sys
import sprig, sprig.kernels, sprig.radix, sprig.runtime
from sprig.runtime import Engine

with Engine(sys.argv[1], dtype="float32", device="cpu", attention_backend="torch") as engine:
    out = engine.generate("the cat", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    constrained = engine.generate("n:", {"max_new_tokens": 8, "regex": "[0-9]{3}"})
print(json.dumps({"triton": "triton" in sys.modules, "ids": out["output_ids"], "digits": constrained["text"]}))
"""


def clean_env() -> dict[str, str]:
    """This environment without the test session's Triton switches."""
    drop = {"TRITON_INTERPRET", "SPRIG_FORCE_TRITON"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"}


def run(model: Path, *, block: bool) -> dict:
    code = (BLOCK_TRITON if block else "") + GENERATE
    env = clean_env()
    done = subprocess.run([sys.executable, "-c", code, str(model)], check=False, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sprig_runs_its_cpu_path_without_triton(tiny_llama: Path) -> None:
    without = run(tiny_llama, block=True)
    assert not without["triton"]
    assert len(without["ids"]) == 8 and len(without["digits"]) == 3 and without["digits"].isdigit()
    assert run(tiny_llama, block=False)["ids"] == without["ids"]


def test_a_triton_kernel_without_triton_says_so() -> None:
    code = BLOCK_TRITON + """
import os, torch
os.environ["SPRIG_FORCE_TRITON"] = "1"
from sprig.kernels import rms_norm
try:
    rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
except RuntimeError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Triton is not installed" in done.stdout
