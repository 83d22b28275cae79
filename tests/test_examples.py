"""Every example, run as a newcomer runs it (`python examples/NAME.py --url URL`) against
one shared real server on the demo model, prints the right answer; afterwards the
server is idle and its KV cache intact.

The examples are deterministic (greedy, or sampled with fixed seeds), so each check
names the answer its question has. SPRIG_EXAMPLES_MODEL=DIR runs them on another
checkpoint (a candidate demo model) instead of the shipped one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Server, running_server

from sprig.runtime.demo import ensure_demo_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT_S = 90
NEEDS = {"agent.py": "openai", "openai_tools.py": "openai", "anthropic_tools.py": "anthropic"}  # optional clients

# what each example must print: its answer (and the steps that lead there), one regex each
SERVED = {
    "agent.py": [
        r'^  calls add\({"a": 14, "b": 9}\) -> 23$',
        r'^  calls multiply\({"a": 23, "b": 2}\) -> 46$',
        r"^final answer: Answer: 46$",
    ],
    "openai_tools.py": [
        r'^finish_reason: tool_calls\ntool call: send_email\({"to": "Ben", "subject": "the party"}\) -> sent\n'
        r"final answer: I sent the email to Ben\.$",
        r'^finish_reason: tool_calls\ntool call: add\({"a": 14, "b": 9}\) -> 23\nfinal answer: Answer: 23$',
    ],
    "anthropic_tools.py": [
        r"^stop_reason: tool_use\ntool use: send_email\(\{'to': 'Ben', 'subject': 'the party'\}\) -> sent\n"
        r"final answer: I sent the email to Ben\.$",
        r"^stop_reason: tool_use\ntool use: add\(\{'a': 14, 'b': 9\}\) -> 23\nfinal answer: Answer: 23$",
    ],
    "json_extraction.py": [
        r"-> Person\(name='Tara Costa', age=29, city='Oslo'\)$",
        r"-> Book\(title='The Silent River', author='Kofi Meyer', year=1987, pages=312\)$",
        r"-> Order\(customer='Sam Novak', item='lamp', quantity=12, price=45\)$",
    ],
    "few_shot_qa.py": [
        r"^How old is Ben\? -> Ben is 34 years old\.\n  \([1-9]\d* of \d+ prompt tokens came from the cache\)$",
        r"^What is Mia's favorite color\? -> Mia's favorite color is green\.$",
        r"^Where does Mia live\? -> Mia lives in Oslo\.$",
    ],
    "streaming_chat.py": [
        r"^assistant: Nice to meet you, Kofi!$",
        r"^user: What is my lucky number plus 5\?\nassistant: 17 \+ 5 = 22\nAnswer: 22$",
    ],
    "best_of_n.py": [r"^best \(mean logprob -?[\d.]+\):\n(?:.+\n)*Answer: 68$"],
    "self_consistency.py": [r"^majority answer: 70$"],
    "tree_search.py": [r"^best path:\n(?:  .+\n)*  Answer: 39$"],
}
OFFLINE = {"generate.py": [r"^\(right answer: 73\)$", r"^A: (?:.+\n)*Answer: 73\n", r"^greedy: +[1-4]/4 correct"]}


@pytest.fixture(scope="module")
def model() -> Path:
    return Path(os.environ.get("SPRIG_EXAMPLES_MODEL") or ensure_demo_model())


@pytest.fixture(scope="module")
def examples_server(model: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """The session's demo server, or one on `SPRIG_EXAMPLES_MODEL` where that is set."""
    if "SPRIG_EXAMPLES_MODEL" not in os.environ:
        server = request.getfixturevalue("demo_server")
        yield server
        server.wait_idle()
        return
    with running_server(model) as server:
        yield server


def run_example(name: str, *args: str) -> str:
    """The example's stdout; it must exit 0 within the timeout."""
    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"{name} needs the {NEEDS[name]} package")
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def assert_prints(out: str, patterns: list[str]) -> None:
    for pattern in patterns:
        assert re.search(pattern, out, re.MULTILINE), f"no line matches {pattern!r} in:\n{out}"


def test_every_example_is_checked():
    assert {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")} == set(SERVED) | set(OFFLINE)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_example_prints_the_right_answer(name: str, examples_server: Server) -> None:
    assert_prints(run_example(name, "--url", examples_server.url), SERVED[name])
    examples_server.wait_idle()


def test_generate_solves_held_out_problems(model: Path) -> None:
    assert_prints(run_example("generate.py", "--model", str(model), "--problems", "4", "-n", "4"),
                  OFFLINE["generate.py"])
