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

import sprig
from sprig.runtime.demo.tasks import take
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


# SGLang's frontend renders role tags itself, with the template its registry matches to the
# server's model path; none matches the demo model's, so a program registers it (README).
SGLANG_ON_THE_DEMO_MODEL = """
import json, sys
import sglang as sgl
from sglang.lang.chat_template import ChatTemplate, register_chat_template

register_chat_template(ChatTemplate(name="sprig-demo", default_system_prompt=None, stop_str=("<|end|>",),
    role_prefix_and_suffix={r: (f"<|{r}|>\\n", "<|end|>\\n") for r in ("system", "user", "assistant")}))

@sgl.function
def solve(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=96, temperature=0))

backend = sgl.RuntimeEndpoint(sys.argv[1], chat_template_name=sys.argv[2])
print(json.dumps([solve.run(question=q, backend=backend)["answer"] for q in json.loads(sys.argv[3])]))
"""


@sprig.function
def _solve(s, question: str) -> None:
    s += sprig.user(question)
    s += sprig.assistant(sprig.gen("answer", max_tokens=96, temperature=0))


def test_sglang_frontend_on_the_demo_model_with_its_roles_registered(demo_server: Server) -> None:
    """With the demo's roles registered, SGLang's frontend answers as sprig's own (which
    asks the server for its roles); with SGLang's fallback template the answers differ."""
    questions = [p.question for p in take("heldout", 3, seed=4)]
    want = [_solve.run(question=q, backend=sprig.RuntimeEndpoint(demo_server.url))["answer"] for q in questions]
    got = {}
    for template in ("sprig-demo", "default"):
        done = subprocess.run([str(PYTHON), "-c", SGLANG_ON_THE_DEMO_MODEL, demo_server.url, template,
                               json.dumps(questions)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        got[template] = json.loads(done.stdout.splitlines()[-1])
    assert got["sprig-demo"] == want and all("Answer: " in a for a in want)
    assert got["default"] != want
    demo_server.wait_idle()
