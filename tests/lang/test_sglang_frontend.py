"""SGLang's real frontend and sprig, both ways, on SGLang's own test programs.

- SGLang's frontend (the `sglang` package from the registry, in the environment
  `scripts/sglang_env.sh` builds) drives `sprig serve` through its `RuntimeEndpoint`;
- the same programs run under sprig's frontend (`import sprig as sgl`).

The programs are SGLang's `sglang/test/test_programs.py`, never copied here: the first
direction imports it in the SGLang environment; the second loads that file from the
environment's site-packages into sprig's own interpreter with `sglang` standing for
`sprig` (sprig's environment does not install sglang, whose import pulls its server's
modules, so the file is read as a plain module; see `sglang_programs.py`). Both run as
subprocesses so neither frontend's global default backend leaks into other tests.

The server runs a tiny random checkpoint with a 4096-token context (SGLang's programs ask
for up to 512 new tokens after long prompts), so programs that check their model's
answer (the capital of the United States, the hours in a day, JSON strings the model
closes in time) may only reach that check: that outcome is "answer"; every other program
must pass. Skipped unless the SGLang environment exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import Server, running_server

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

HERE = Path(__file__).parent
ENV = Path(os.environ.get("SGLANG_ENV", HERE.parents[1] / ".venv-sglang"))
PYTHON = ENV / "bin" / "python"
RUNNER = HERE / "sglang_programs.py"
MODEL_CHECKED = {"test_few_shot_qa", "test_decode_int", "test_decode_json_regex", "test_decode_json", "test_react"}
PROGRAMS = {"test_mt_bench", "test_select", "test_expert_answer", "test_parallel_decoding", "test_stream",
            "test_stream_logprobs", "test_regex", "test_dtype_gen"} | MODEL_CHECKED

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason=f"no SGLang environment at {ENV}: build it with "
                       "`bash scripts/sglang_env.sh` to run SGLang's test programs both ways"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_checkpoint(tmp_path_factory.mktemp("sglang") / "llama", "llama", max_position_embeddings=4096)
    with running_server(model) as s:
        yield s


@pytest.fixture(scope="module")
def site_packages() -> Path:
    out = subprocess.run([str(PYTHON), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    site = Path(out.stdout.strip())
    if not (site / "sglang" / "test" / "test_programs.py").is_file():
        pytest.skip(f"{ENV} has no sglang/test/test_programs.py: rebuild it with scripts/sglang_env.sh")
    return site


def _run(python: Path | str, *args: str) -> dict[str, dict]:
    done = subprocess.run([str(python), str(RUNNER), *args], capture_output=True, text=True, timeout=900)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and reports, done.stdout[-3000:] + done.stderr[-3000:]
    table = {r["program"]: r for r in reports}
    for name, r in table.items():  # `pytest -s` shows which pass each way
        print(f"{name:26} {r['outcome']:7} attempts {r['attempts']}  {r['error'] or ''}"[:160])
    return table


def _check(table: dict[str, dict]) -> None:
    assert set(table) == PROGRAMS
    failed = {n: r["error"] for n, r in table.items() if r["outcome"] != "pass" and n not in MODEL_CHECKED}
    assert not failed, failed
    assert all(table[n]["outcome"] in ("pass", "answer") for n in MODEL_CHECKED), table


def test_sglang_frontend_drives_sprig(server: Server, site_packages: Path) -> None:
    _check(_run(PYTHON, server.url))
    server.wait_idle()


def test_sprig_frontend_runs_sglang_programs(server: Server, site_packages: Path) -> None:
    table = _run(sys.executable, server.url, "--as-sprig", str(site_packages))
    _check(table)
    assert table["test_stream_logprobs"]["attempts"] == 1  # sprig's own iterator does not race
    server.wait_idle()
