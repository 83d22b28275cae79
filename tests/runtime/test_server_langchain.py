"""Agent clients on a default `sprig serve` (no flags): LangChain's `bind_tools` with a
required or named tool, `with_structured_output` by function calling, by JSON schema and
in JSON mode (over chat completions, and over the Responses API on the demo model), and
the official `openai` client's forced calls, plain and streamed.

Two servers: one on a checkpoint whose chat template teaches no tool-call format (a
forced call is then bare JSON, which needs no `--tool-call-parser`), and the session
server, whose template teaches Hermes `<tool_call>`. Every value the random tiny model
writes must validate against its schema. JSON mode constrains only to some JSON object,
which a random model need not ever close: it runs on the demo model, which writes JSON."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_helpers import Server, running_server
from transformers import AutoTokenizer

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

langchain_openai = pytest.importorskip("langchain_openai")
openai = pytest.importorskip("openai")

PLAIN_TEMPLATE = (  # no tools, no tool-call markers
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + (message['content'] or '') + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
QUESTION = "what is the weather in Rome ?"


class Weather(BaseModel):
    """Get the weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7, description="how many days ahead")


class Time(BaseModel):
    """Get the time in a city."""

    city: Literal["Paris", "Rome", "Oslo"]


SCHEMAS = {"Weather": Weather.model_json_schema(), "Time": Time.model_json_schema()}


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "plain", "llama", seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = PLAIN_TEMPLATE
    tok.save_pretrained(path)
    with running_server(path) as s:
        yield s


@pytest.fixture(scope="module", params=["plain", "hermes"])
def served(request: pytest.FixtureRequest) -> Iterator[Server]:
    server = request.getfixturevalue("plain_server" if request.param == "plain" else "server")
    yield server
    server.wait_idle()


def llm(server: Server, **kw) -> langchain_openai.ChatOpenAI:
    model = server.get("/v1/models").json()["data"][0]["id"]
    return langchain_openai.ChatOpenAI(model=model, base_url=server.url + "/v1", api_key="unused",
                                       max_tokens=300, max_retries=0, timeout=60, **{"temperature": 0, **kw})


def valid_calls(calls: list[dict]) -> list[str]:
    for call in calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    return [call["name"] for call in calls]


def test_bind_tools_required_calls_a_tool(served: Server) -> None:
    for seed in range(3):
        message = llm(served, seed=seed, temperature=1.0).bind_tools([Weather, Time], tool_choice="required").invoke(
            QUESTION)
        assert len(valid_calls(message.tool_calls)) == 1 and not message.invalid_tool_calls


def test_bind_tools_named_calls_that_tool(served: Server) -> None:
    message = llm(served).bind_tools([Weather, Time], tool_choice="Time").invoke(QUESTION)
    assert valid_calls(message.tool_calls) == ["Time"]
    chunks = list(llm(served).bind_tools([Weather, Time], tool_choice="Time").stream(QUESTION))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert valid_calls(streamed.tool_calls) == ["Time"] and streamed.tool_calls[0]["args"] == message.tool_calls[0][
        "args"]


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output(served: Server, method: str) -> None:
    for seed in range(2):
        out = llm(served, seed=seed, temperature=1.0).with_structured_output(Weather, method=method).invoke(QUESTION)
        assert isinstance(out, Weather)
        jsonschema.validate(out.model_dump(), SCHEMAS["Weather"])


def test_with_structured_output_json_mode(demo_server: Server) -> None:
    text = "Text: Tara Costa is 29 years old. Tara lives in Oslo.\nGive the name, age and city as JSON."
    out = llm(demo_server).with_structured_output(None, method="json_mode").invoke(text)
    demo_server.wait_idle()
    assert out == {"name": "Tara Costa", "age": 29, "city": "Oslo"}


def test_the_responses_api_path_calls_tools_and_fills_schemas(demo_server: Server) -> None:
    """`ChatOpenAI(use_responses_api=True)` speaks `/v1/responses`: a named tool's call,
    streamed or not, and structured output by each method, on the demo model."""
    class Person(BaseModel):
        name: str
        age: int
        city: str

    responses = {"use_responses_api": True}
    tools = llm(demo_server, **responses).bind_tools([Weather], tool_choice="Weather")
    message = tools.invoke(QUESTION)
    assert valid_calls(message.tool_calls) == ["Weather"] and message.tool_calls[0]["args"]["city"] == "Rome"
    chunks = list(tools.stream(QUESTION))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.tool_calls[0]["args"] == message.tool_calls[0]["args"]
    text = "Text: Tara Costa is 29 years old. Tara lives in Oslo.\nGive the name, age and city as JSON."
    for method in ("json_schema", "function_calling"):
        out = llm(demo_server, **responses).with_structured_output(Person, method=method).invoke(text)
        assert out == Person(name="Tara Costa", age=29, city="Oslo"), method
    assert llm(demo_server, **responses).with_structured_output(None, method="json_mode").invoke(text) == \
        {"name": "Tara Costa", "age": 29, "city": "Oslo"}
    demo_server.wait_idle()


def test_auto_without_a_format_is_plain_text(plain_server: Server) -> None:
    written = '{"name": "Weather", "arguments": {"city": "Rome", "days": 2}}'
    r = plain_server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 100, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "Weather", "parameters": SCHEMAS["Weather"]}}],
        "regex": re.escape(written)})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": written} and choice["finish_reason"] == "stop"


def test_openai_client_forced_call_without_a_parser(plain_server: Server) -> None:
    tools = [{"type": "function", "function": {"name": "Weather", "parameters": SCHEMAS["Weather"]}}]
    model = plain_server.get("/v1/models").json()["data"][0]["id"]
    with openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        kw = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "tools": tools,
              "tool_choice": "required", "max_tokens": 300, "temperature": 0}
        out = client.chat.completions.create(**kw)
        [call] = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["Weather"])
        chunks = list(client.chat.completions.create(**kw, stream=True))
        pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(pieces) > 2 and pieces[0].function.name == "Weather"  # streamed as it is written
        assert "".join(p.function.arguments for p in pieces) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain_server.wait_idle()
