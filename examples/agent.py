"""A tool-using agent: the model is offered calculator tools through the OpenAI API and
decides itself when to call one (`tool_choice="auto"`); the program runs every call and
hands the result back as a `tool` message, until the model answers without a call.

The server renders the tools into the prompt with the model's chat template and reads
the calls the model writes back into `message.tool_calls` (the demo model writes
Hermes calls, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`).

    python examples/agent.py [--url URL | --model PATH]      # needs `pip install openai`
"""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
from _backend import parser, server_url

TASK = "Ivan has 14 coins. Then Ivan buys 9 more. Then Ivan doubles them. How many coins does Ivan have now?"
CALCULATOR: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("Add two whole numbers.", lambda a, b: a + b),
    "subtract": ("Subtract the second whole number from the first.", lambda a, b: a - b),
    "multiply": ("Multiply two whole numbers.", lambda a, b: a * b),
    "divide": ("Divide the first whole number by the second, rounding down.", lambda a, b: a // b),
}
PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": PARAMETERS}}
         for name, (description, _) in CALCULATOR.items()]


def run_tool(name: str, arguments: str) -> str:
    """A call's result, or an error message the model reads instead."""
    try:
        args = json.loads(arguments)
        return str(CALCULATOR[name][1](args["a"], args["b"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        return f"error: {e!r}"


def agent(client: openai.OpenAI, task: str, max_turns: int = 6) -> str | None:
    """The model's final answer to `task` (None if it is still calling tools after `max_turns`)."""
    messages: list[dict] = [{"role": "user", "content": task}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                               tool_choice="auto", temperature=0, max_tokens=96)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"  calls {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def main() -> None:
    args = parser(__doc__).parse_args()
    with server_url(args) as url:
        print(f"task: {TASK}")
        answer = agent(openai.OpenAI(base_url=url + "/v1", api_key="none"), TASK)
    print(f"final answer: {answer}")


if __name__ == "__main__":
    main()
