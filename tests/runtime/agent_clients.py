"""instructor, litellm and the OpenAI Agents SDK driving a running `sprig serve`, as their
users write them. Run in the environment `scripts/clients_env.sh` builds (instructor pins
an older `openai` than sprig's own environment has):

    python tests/runtime/agent_clients.py URL MODEL

Prints one JSON line per check, `{"check": NAME, "result": ...}`, or `{"check": NAME,
"error": ...}` when the library raised; `test_server_agent_clients.py` compares each
result with the same request made directly. Exits non-zero only if it cannot run at all.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list from GitHub otherwise

import agents
import instructor
import litellm
import openai
from pydantic import BaseModel, field_validator

URL, MODEL = sys.argv[1], sys.argv[2]
TEXT = "Tara Costa is 29 years old. Tara lives in Oslo. Tara likes chess."
MESSAGES = [{"role": "user", "content": TEXT}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
QUESTION = [{"role": "user", "content": "What is 14 plus 9?"}]
AGENT_TASK = "Ivan has 14 coins. Then Ivan buys 9 more. Then Ivan doubles them. How many coins does Ivan have now?"
LITELLM = {"model": f"openai/{MODEL}", "api_base": URL + "/v1", "api_key": "unused", "max_retries": 0}


class Person(BaseModel):
    name: str
    age: int
    city: str


def _client(mode: instructor.Mode) -> instructor.Instructor:
    return instructor.from_openai(openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0), mode=mode)


def extract(mode: str) -> dict[str, Any]:
    person = _client(instructor.Mode[mode]).chat.completions.create(
        model=MODEL, response_model=Person, messages=MESSAGES, temperature=0, max_retries=0)
    return person.model_dump()


def partials() -> list[dict[str, Any]]:
    stream = _client(instructor.Mode.TOOLS).chat.completions.create_partial(
        model=MODEL, response_model=Person, messages=MESSAGES, temperature=0, max_retries=0)
    return [p.model_dump() for p in stream]


def extract_async() -> dict[str, Any]:
    client = instructor.from_openai(openai.AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0))

    async def one() -> Person:
        return await client.chat.completions.create(model=MODEL, response_model=Person, messages=MESSAGES,
                                                    temperature=0, max_retries=0)

    async def both() -> list[Person]:
        return await asyncio.gather(one(), one())

    first, second = asyncio.run(both())
    return {"first": first.model_dump(), "second": second.model_dump()}


def reask() -> dict[str, Any]:
    """A validator that refuses the first answer: instructor sends the conversation back
    with the error (the call, then a tool message), and the second answer is returned."""
    seen: list[str] = []

    class Checked(Person):
        @field_validator("name")
        @classmethod
        def once(cls, name: str) -> str:
            seen.append(name)
            if len(seen) == 1:
                raise ValueError("write the name in capital letters")
            return name

    person = _client(instructor.Mode.TOOLS).chat.completions.create(
        model=MODEL, response_model=Checked, messages=MESSAGES, temperature=0, max_retries=2)
    return {"attempts": len(seen), "person": person.model_dump()}


def completion(**kw: Any) -> dict[str, Any]:
    r = litellm.completion(**{"messages": QUESTION, "temperature": 0, "max_tokens": 24, **LITELLM, **kw})
    choice = r.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "finish_reason": choice.finish_reason, "tool_calls": calls,
            "usage": [r.usage.prompt_tokens, r.usage.completion_tokens]}


def stream() -> dict[str, Any]:
    chunks = list(litellm.completion(messages=QUESTION, temperature=0, max_tokens=24, stream=True, **LITELLM))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return {"content": text, "finish_reason": reasons[-1], "chunks": len(chunks)}


def text_completion() -> str:
    r = litellm.text_completion(model=f"text-completion-openai/{MODEL}", api_base=URL + "/v1", api_key="unused",
                                prompt="Mia has 3 red pens and 4 blue pens.", max_tokens=16, temperature=0)
    return r.choices[0].text


def embedding() -> list[list[float]]:
    r = litellm.embedding(input=[TEXT, QUESTION[0]["content"]], **LITELLM)
    return [d["embedding"] for d in r.data]


def concurrent() -> list[str]:
    async def all_at_once() -> list[Any]:
        return await asyncio.gather(*(
            litellm.acompletion(messages=[{"role": "user", "content": f"What is {i} plus {i + 3}?"}], temperature=0,
                                max_tokens=24, **LITELLM) for i in range(4)))

    return [r.choices[0].message.content for r in asyncio.run(all_at_once())]


@agents.function_tool
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@agents.function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers."""
    return a * b


def _agent(**kw: Any) -> agents.Agent:
    """An agent on the server's `/v1/responses` (the SDK's default model API), greedy; a
    client per event loop, as each check runs its own."""
    client = openai.AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)
    return agents.Agent(name="sprig", model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=96), **kw)


def agent_run(streamed: bool) -> dict[str, Any]:
    """The calculator agent's task: each call the model made, and its final output."""
    agents.set_tracing_disabled(True)  # the SDK sends traces to OpenAI otherwise

    async def run() -> agents.RunResult | agents.RunResultStreaming:
        agent = _agent(tools=[add, multiply])
        if not streamed:
            return await agents.Runner.run(agent, AGENT_TASK)
        result = agents.Runner.run_streamed(agent, AGENT_TASK)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(run())
    calls = [[item.raw_item.name, json.loads(item.raw_item.arguments)] for item in result.new_items
             if isinstance(item, agents.ToolCallItem)]
    return {"calls": calls, "final": result.final_output}


def agent_output_type() -> dict[str, Any]:
    """An agent with a structured output type (`text.format`, a strict JSON schema)."""
    agents.set_tracing_disabled(True)
    person = asyncio.run(agents.Runner.run(_agent(output_type=Person), TEXT)).final_output
    return person.model_dump()


CHECKS: dict[str, Callable[[], Any]] = {
    "instructor_tools": lambda: extract("TOOLS"),
    "instructor_tools_strict": lambda: extract("TOOLS_STRICT"),
    "instructor_json_schema": lambda: extract("JSON_SCHEMA"),
    "instructor_partial": partials,
    "instructor_async": extract_async,
    "instructor_reask": reask,
    "litellm_completion": completion,
    "litellm_seeded": lambda: completion(temperature=0.9, seed=7),
    "litellm_stream": stream,
    "litellm_tool_call": lambda: completion(tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                                            max_tokens=64),
    "litellm_tools_auto": lambda: completion(tools=[ADD], max_tokens=64),
    "litellm_text_completion": text_completion,
    "litellm_concurrent": concurrent,
    "litellm_embedding": embedding,
    "agents_run": lambda: agent_run(streamed=False),
    "agents_run_streamed": lambda: agent_run(streamed=True),
    "agents_output_type": agent_output_type,
}


def main() -> None:
    for name, check in CHECKS.items():
        try:
            line = {"check": name, "result": check()}
        except Exception as e:  # reported to the test, which names the check that failed
            line = {"check": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
