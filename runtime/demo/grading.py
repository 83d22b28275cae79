"""Whether a reply of the demo model is right: the checks its held-out evaluation, the
examples' test and the training script share.

Tool calls are read with the server's own Hermes parser, so "well-formed" means what
`/v1/chat/completions` would turn into `tool_calls`.
"""

from __future__ import annotations

import json
from typing import Any

from sprig.runtime.demo.tasks import extract_answer
from sprig.runtime.server.tool_calls import FORMATS, ToolCall

HERMES = FORMATS["hermes"]


def tool_calls(reply: str) -> list[ToolCall] | None:
    """The calls in `reply` if it is well-formed Hermes tool calls, else None."""
    parsed = HERMES.parse(reply)
    return None if parsed is None else parsed[1]


def same_call(got: ToolCall, name: str, arguments: dict[str, Any]) -> bool:
    """`got` calls `name` with exactly `arguments` (values and types)."""
    return got.name == name and json.loads(got.arguments) == arguments


def states(reply: str, answer: str) -> bool:
    """`reply` states `answer`: the same `Answer: N` number when `answer` is one,
    else the same text (surrounding blanks aside)."""
    if answer.startswith("Answer:"):
        return extract_answer(reply) == extract_answer(answer)
    return reply.strip() == answer.strip()


def json_reply(reply: str, schema: dict[str, Any]) -> tuple[bool, Any]:
    """(valid, value): whether `reply` is one JSON value that validates against `schema`,
    and the value (None when it does not parse). Needs `jsonschema` (a dev dependency)."""
    import jsonschema

    try:
        value = json.loads(reply)
    except ValueError:
        return False, None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False, value
    return True, value
