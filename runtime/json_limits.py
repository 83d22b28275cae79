"""A bound on how deeply nested the JSON a client sends may be.

Python's `json` and the code that walks a schema recurse once per level: a body a few
kilobytes long can nest thousands of levels and end in a `RecursionError`. Every JSON
value a client sends (a request body, a schema or tool arguments inside a string) is
checked against `MAX_JSON_DEPTH` first, and refused as a `ValueError` naming it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64  # JSON schemas and tool arguments seen in practice nest fewer than 20 levels


def json_depth(value: Any) -> int:
    """Levels of nested arrays and objects in a parsed JSON value (a scalar is 0); walks
    iteratively, so any depth is measured without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_depth(value: Any, what: str) -> Any:
    """`value` itself; `ValueError` if it nests deeper than `MAX_JSON_DEPTH`."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def loads(text: str, what: str) -> Any:
    """`json.loads(text)` within the depth bound; `ValueError` (naming `what`) for text
    that is not JSON or nests too deeply."""
    try:
        return check_depth(json.loads(text), what)
    except RecursionError:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
