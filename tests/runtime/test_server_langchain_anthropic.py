"""LangChain's `ChatAnthropic` on a default `sprig serve` of the demo model, through
Anthropic's Messages API, unchanged: a tool bound and called, its result sent back for the
answer; `with_structured_output` (a forced tool call) filling a pydantic model; a stream
that adds up to the whole answer."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from server_helpers import Server

langchain_anthropic = pytest.importorskip("langchain_anthropic")
messages = pytest.importorskip("langchain_core.messages")
tools = pytest.importorskip("langchain_core.tools")

QUESTION = "Ivan has 14 coins. Then Ivan buys 9 more. How many coins does Ivan have now?"


@tools.tool
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


class Weather(BaseModel):
    """Get the weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7, description="how many days ahead")


@pytest.fixture
def llm(demo_server: Server):
    yield langchain_anthropic.ChatAnthropic(model="default", base_url=demo_server.url, api_key="none", temperature=0,
                                            max_tokens=64, max_retries=0)
    demo_server.wait_idle()


def test_a_bound_tool_is_called_and_its_result_answered(llm) -> None:
    bound = llm.bind_tools([add])
    called = bound.invoke(QUESTION)
    assert called.response_metadata["stop_reason"] == "tool_use"
    [call] = called.tool_calls
    assert (call["name"], call["args"]) == ("add", {"a": 14, "b": 9}) and call["id"].startswith("toolu_")
    result = messages.ToolMessage(str(add.invoke(call["args"])), tool_call_id=call["id"])
    answer = bound.invoke([messages.HumanMessage(QUESTION), called, result])
    assert answer.content == "Answer: 23" and answer.response_metadata["stop_reason"] == "end_turn"


def test_structured_output_fills_the_model(llm) -> None:
    weather = llm.with_structured_output(Weather).invoke("What will the weather be in Rome in two days?")
    assert isinstance(weather, Weather)  # a forced call, its arguments held to the schema


def test_a_stream_adds_up_to_the_answer(llm) -> None:
    whole = llm.invoke(QUESTION).content
    pieces = [chunk.content for chunk in llm.stream(QUESTION)]
    text = "".join(p if isinstance(p, str) else "".join(b.get("text", "") for b in p) for p in pieces)
    assert text == whole and whole
