"""Tool use through Anthropic's Messages API, with the official `anthropic` client, as an
agent built on Anthropic's SDK runs it against a local model: each request offers two
tools; the answer's `tool_use` blocks (`stop_reason "tool_use"`) are run by the program
and their results go back as `tool_result` blocks for the final answer.

`sprig serve` answers `/v1/messages` as the chat completion of the same conversation, so
the model calls tools in the format its chat template teaches (`--tool-call-parser`).
The client takes the server's root URL; sampling fields its newest releases no longer
spell out (`temperature`) go in `extra_body`.

    python examples/anthropic_tools.py [--url URL | --model PATH]   # needs `pip install anthropic`
"""

from __future__ import annotations

import anthropic
from _backend import parser, server_url

QUESTIONS = ["Send an email to Ben about the party.",
             "Ivan has 14 coins. Then Ivan buys 9 more. How many coins does Ivan have now?"]
GREEDY = {"temperature": 0}


def tool(name: str, description: str, **params: str) -> dict:
    """An Anthropic client tool whose inputs all have the JSON types `params` gives."""
    properties = {p: {"type": kind} for p, kind in params.items()}
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": properties, "required": list(properties)}}


TOOLS = [
    tool("send_email", "Send an email to a person.", to="string", subject="string"),
    tool("add", "Add two whole numbers.", a="integer", b="integer"),
]
RUN = {"send_email": lambda to, subject: "sent", "add": lambda a, b: str(a + b)}  # stand-ins for real tools


def ask(client: anthropic.Anthropic, question: str) -> str:
    messages: list[dict] = [{"role": "user", "content": question}]
    first = client.messages.create(model="default", max_tokens=64, messages=messages, tools=TOOLS,
                                   extra_body=GREEDY)
    print(f"user: {question}\nstop_reason: {first.stop_reason}")
    uses = [block for block in first.content if block.type == "tool_use"]
    if not uses:
        return "".join(block.text for block in first.content if block.type == "text")
    messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]})
    results = []
    for use in uses:
        result = RUN[use.name](**use.input)
        print(f"tool use: {use.name}({use.input}) -> {result}")
        results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
    messages.append({"role": "user", "content": results})
    final = client.messages.create(model="default", max_tokens=64, messages=messages, tools=TOOLS, extra_body=GREEDY)
    return "".join(block.text for block in final.content if block.type == "text")


def main() -> None:
    args = parser(__doc__).parse_args()
    with server_url(args) as url:
        client = anthropic.Anthropic(base_url=url, api_key="none")
        for question in QUESTIONS:
            print(f"final answer: {ask(client, question)}\n")


if __name__ == "__main__":
    main()
