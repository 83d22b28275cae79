"""The demo model's chat template and the tokens it is written in.

Roles are `<|system|>`, `<|user|>`, `<|assistant|>`, each turn closed by `<|end|>` (the
eos). Tools, when a request has them, open the conversation in a system turn (after the
conversation's own system message, if it has one), one function per line as JSON. The
assistant calls them in the Hermes format, `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` (one block per call, on lines of their own), and a tool's answer
comes back in a user turn as `<tool_response>\\n...\\n</tool_response>`, as Qwen2.5's
template writes it, so a program that has only user and assistant roles can hand a
result back in exactly the text the template renders.

The template is one line of Jinja without literal newlines outside strings, so it
renders the same under `trim_blocks` / `lstrip_blocks` (transformers and the server) as
without them. An assistant's call arguments may be an object or JSON text.
"""

from __future__ import annotations

import json
from typing import Any

SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# plain (not special) added tokens: decoding keeps them, so a parser sees the markers
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS_HEADER = "You can call these tools:\n<tools>\n"
TOOLS_FOOTER = '</tools>\nTo call one, answer <tool_call>\n{"name": <tool name>, "arguments": <arguments object>}\n</tool_call>'

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + repr(TOOLS_HEADER) + " }}"
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\\n' }}"
    "{% endfor %}"
    "{{ " + repr(TOOLS_FOOTER + "<|end|>\n") + " }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The system turn's text the template writes for `tools` (OpenAI function tools) when
    the conversation has no system message of its own: a program with only the usual roles
    that sends it as its system message gets exactly the prompt the server renders."""
    lines = "".join(json.dumps(t.get("function", t), ensure_ascii=False) + "\n" for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """One call as the template writes it (and the model is trained to)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
