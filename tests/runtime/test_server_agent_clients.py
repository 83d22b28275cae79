"""instructor, litellm and the OpenAI Agents SDK, the agent libraries, drive `sprig serve`
on the demo model unchanged: `agent_clients.py` runs their calls in the environment `scripts/clients_env.sh`
builds (instructor pins an older `openai` than sprig's environment has), and each result
is checked here against the same request made directly with the official client, or
against the right answer where the library builds the request itself (instructor's, the
Agents SDK's, whose requests go to `/v1/responses`).

Skipped unless that environment exists."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Server

openai = pytest.importorskip("openai")

HERE = Path(__file__).parent
ENV = Path(os.environ.get("CLIENTS_ENV", HERE.parents[1] / ".venv-clients"))
PYTHON = ENV / "bin" / "python"
DRIVER = HERE / "agent_clients.py"
TARA = {"name": "Tara Costa", "age": 29, "city": "Oslo"}  # what the demo model extracts from the driver's TEXT
QUESTION = [{"role": "user", "content": "What is 14 plus 9?"}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PYTHON.is_file(), reason=f"no clients environment at {ENV}: build it with "
                       "`bash scripts/clients_env.sh` to drive the server with instructor, litellm and the "
                       "Agents SDK"),
]


@pytest.fixture(scope="module")
def demo(demo_server: Server) -> Iterator[Server]:
    yield demo_server
    demo_server.wait_idle()


class Results:
    """The driver's lines by check; `[name]` is a check's result, or fails the test that
    asks with the library's traceback."""

    def __init__(self, lines: list[dict[str, Any]]) -> None:
        self.lines = {line["check"]: line for line in lines}

    def __getitem__(self, name: str) -> Any:
        line = self.lines[name]
        assert "error" not in line, f"{name}: {line.get('trace')}"
        return line["result"]


@pytest.fixture(scope="module")
def results(demo: Server) -> Results:
    """Every check, run by the driver in one process (the libraries take seconds to import)."""
    model = demo.get("/v1/models").json()["data"][0]["id"]
    done = subprocess.run([str(PYTHON), str(DRIVER), demo.url, model], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Results([json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")])


@dataclass(frozen=True)
class Direct:
    """The official client (sprig's environment's release) on the same server."""

    client: Any
    model: str

    def chat(self, **kw: Any) -> dict[str, Any]:
        """A chat completion of `QUESTION` (greedy, 24 tokens unless `kw` says otherwise),
        in the shape `agent_clients.completion` reports."""
        r = self.client.chat.completions.create(**{"model": self.model, "messages": QUESTION, "temperature": 0,
                                                   "max_tokens": 24, **kw})
        choice = r.choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "finish_reason": choice.finish_reason, "tool_calls": calls,
                "usage": [r.usage.prompt_tokens, r.usage.completion_tokens]}


@pytest.fixture(scope="module")
def direct(demo: Server) -> Iterator[Direct]:
    model = demo.get("/v1/models").json()["data"][0]["id"]
    with openai.OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield Direct(client, model)


@pytest.mark.parametrize("mode", ["tools", "tools_strict", "json_schema"])
def test_instructor_extracts_into_a_pydantic_model(results: Results, mode: str) -> None:
    assert results[f"instructor_{mode}"] == TARA


def test_instructor_streams_partial_objects(results: Results) -> None:
    partials = results["instructor_partial"]
    assert len(partials) > 2 and partials[-1] == TARA  # the forced call streams as it is written


def test_instructor_async_client(results: Results) -> None:
    assert results["instructor_async"] == {"first": TARA, "second": TARA}


def test_instructor_reasks_after_a_validation_error(results: Results) -> None:
    """The second attempt's conversation holds the first call and a tool message with the
    validator's error: the server renders it and answers."""
    out = results["instructor_reask"]
    assert out["attempts"] == 2 and set(out["person"]) == set(TARA) and isinstance(out["person"]["age"], int)


def test_litellm_completion_equals_the_official_client(results: Results, direct: Direct) -> None:
    assert results["litellm_completion"] == direct.chat()
    assert results["litellm_seeded"] == direct.chat(temperature=0.9, seed=7)  # litellm passes the seed on


def test_litellm_stream_joins_to_the_whole_answer(results: Results, direct: Direct) -> None:
    whole = direct.chat()
    streamed = results["litellm_stream"]
    assert (streamed["content"], streamed["finish_reason"]) == (whole["content"], whole["finish_reason"])
    assert streamed["chunks"] > 2


def test_litellm_tool_calls(results: Results, direct: Direct) -> None:
    forced = results["litellm_tool_call"]
    assert forced == direct.chat(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                            max_tokens=64)
    [call] = forced["tool_calls"]
    assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}
    assert results["litellm_tools_auto"] == direct.chat(tools=[ADD], max_tokens=64)


def test_litellm_text_completion(results: Results, direct: Direct) -> None:
    r = direct.client.completions.create(model=direct.model, prompt="Mia has 3 red pens and 4 blue pens.",
                                         max_tokens=16, temperature=0)
    assert results["litellm_text_completion"] == r.choices[0].text


def test_litellm_embeddings_equal_the_official_clients(results: Results, direct: Direct) -> None:
    texts = ["Tara Costa is 29 years old. Tara lives in Oslo. Tara likes chess.", QUESTION[0]["content"]]  # the driver's
    want = direct.client.embeddings.create(model=direct.model, input=texts)
    got = results["litellm_embedding"]
    assert len(got) == 2
    for g, w in zip(got, want.data, strict=True):
        assert g == pytest.approx(w.embedding, abs=1e-5)


def test_litellm_concurrent_requests_each_equal_alone(results: Results, direct: Direct) -> None:
    alone = [direct.chat(messages=[{"role": "user", "content": f"What is {i} plus {i + 3}?"}])["content"]
             for i in range(4)]
    assert results["litellm_concurrent"] == alone


def test_agents_sdk_agent_calls_its_tools_and_answers(results: Results) -> None:
    """The Agents SDK's runner on `/v1/responses`: the demo model adds, multiplies the sum
    it was handed back, and answers with the product."""
    run = results["agents_run"]
    assert run == {"calls": [["add", {"a": 14, "b": 9}], ["multiply", {"a": 23, "b": 2}]], "final": "Answer: 46"}
    assert results["agents_run_streamed"] == run


def test_agents_sdk_structured_output(results: Results) -> None:
    assert results["agents_output_type"] == TARA
