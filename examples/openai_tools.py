"""Tool calling through the OpenAI API, with the official `openai` client: the model is
made to call a tool (`tool_choice="required"`: its answer is constrained to one call whose
arguments match the tool's schema), the program runs the tool, and the result goes back
as a `tool` message for the final answer.

The local server runs with `--tool-call-parser hermes`, since the demo model's chat
template teaches no tool-call format of its own (a Qwen or Llama 3.1 checkpoint's does,
and "auto" finds it).

    python examples/openai_tools.py [--url URL | --model PATH]      # needs `pip install openai`
"""

from __future__ import annotations

import json

import openai
from _backend import parser

import sprig

TASK = "Ivan has 14 coins. Ivan buys 9 more. How many coins does Ivan have?"
NUMBER = {"type": "integer", "minimum": 0, "maximum": 999}
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two whole numbers.",
    "parameters": {"type": "object", "properties": {"a": NUMBER, "b": NUMBER}, "required": ["a", "b"]},
}}]


def solve(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages: list[dict] = [{"role": "user", "content": TASK}]
    first = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=0, max_tokens=128)
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    result = args["a"] + args["b"]
    print(f"{TASK}\nthe model calls {call.function.name}({args}) -> {result}")
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    final = client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=32)
    print("final answer:", final.choices[0].message.content)


def main() -> None:
    args = parser(__doc__).parse_args()
    if args.url:
        solve(args.url)
        return
    print("starting a local sprig server ...", flush=True)
    with sprig.Runtime(args.model, tool_call_parser="hermes") as runtime:
        solve(runtime.url)


if __name__ == "__main__":
    main()
