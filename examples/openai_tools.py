"""Tool calling through the OpenAI API, with the official `openai` client: each request
offers two tools and lets the model choose (`tool_choice="auto"`, the default with
tools); a call comes back as `message.tool_calls` with `finish_reason "tool_calls"`, the
program runs it, and the result goes back as a `tool` message for the final answer.

The server reads calls in the format the model's chat template teaches (for the demo
model and Qwen, Hermes `<tool_call>` blocks; Llama 3.1 and Mistral have their own):
`sprig serve`'s default `--tool-call-parser auto` finds it.

    python examples/openai_tools.py [--url URL | --model PATH]      # needs `pip install openai`
"""

from __future__ import annotations

import json

import openai
from _backend import parser, server_url

QUESTIONS = ["Send an email to Ben about the party.",
             "Ivan has 14 coins. Then Ivan buys 9 more. How many coins does Ivan have now?"]


def function(name: str, description: str, **params: str) -> dict:
    """An OpenAI function tool whose parameters all have the JSON types `params` gives."""
    properties = {p: {"type": kind} for p, kind in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


TOOLS = [
    function("send_email", "Send an email to a person.", to="string", subject="string"),
    function("add", "Add two whole numbers.", a="integer", b="integer"),
]
RUN = {"send_email": lambda to, subject: "sent", "add": lambda a, b: str(a + b)}  # stand-ins for real tools


def ask(client: openai.OpenAI, question: str) -> str | None:
    messages: list[dict] = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice="auto",
                                           temperature=0, max_tokens=64)
    choice = first.choices[0]
    print(f"user: {question}\nfinish_reason: {choice.finish_reason}")
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls or []:
        result = RUN[call.function.name](**json.loads(call.function.arguments))
        print(f"tool call: {call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not choice.message.tool_calls:
        return choice.message.content
    final = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=64)
    return final.choices[0].message.content


def main() -> None:
    args = parser(__doc__).parse_args()
    with server_url(args) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for question in QUESTIONS:
            print(f"final answer: {ask(client, question)}\n")


if __name__ == "__main__":
    main()
