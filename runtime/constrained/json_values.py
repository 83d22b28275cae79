"""How `json_schema` reads keyword values: their required types (`VALUE_RULES`, since
outlines-core silently ignores an ill-typed value), numeric bounds, and the regexes of
the string formats it supports (over raw JSON string content: nothing that needs
escaping; ASCII digits; calendar-correct dates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sprig.runtime.constrained.numeric_ranges import Bound

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"  # calendar dates only
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_EMAIL_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
    "email": rf"{_EMAIL_ATOM}(?:\.{_EMAIL_ATOM})*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{{2,}}",
    "uri": r"[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]+",
}


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _schemas(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0


# Keyword values outlines-core would silently ignore when ill-typed: (check, what it must be).
VALUE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{
        k: (_count, "a non-negative integer")
        for k in (
            "minLength",
            "maxLength",
            "minItems",
            "maxItems",
            "minProperties",
            "maxProperties",
        )
    },
    "pattern": (lambda v: isinstance(v, str), "a string"),
    "format": (lambda v: isinstance(v, str), "a string"),
    "$ref": (lambda v: isinstance(v, str), "a string"),
    "uniqueItems": (lambda v: isinstance(v, bool), "a boolean"),
    "required": (
        lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
        "a list of strings",
    ),
    "properties": (lambda v: isinstance(v, dict), "an object"),
    "enum": (_schemas, "a non-empty array"),
    "type": (
        lambda v: isinstance(v, str) or (_schemas(v) and all(isinstance(t, str) for t in v)),
        "a type name or a list of them",
    ),
    **{
        k: (_schemas, "a non-empty array of schemas")
        for k in ("anyOf", "oneOf", "allOf", "prefixItems")
    },
}


def _bounds(
    node: dict[str, Any], path: str
) -> tuple[list[tuple[float, bool]], list[tuple[float, bool]]]:
    """(lower, upper) bounds as (value, exclusive); draft-4 boolean exclusives included."""
    lower: list[tuple[float, bool]] = []
    upper: list[tuple[float, bool]] = []
    for keyword, side, flag in (
        ("minimum", lower, "exclusiveMinimum"),
        ("maximum", upper, "exclusiveMaximum"),
    ):
        if keyword in node:
            side.append((node[keyword], node.get(flag) is True))
        if flag in node and not isinstance(node[flag], bool):
            side.append((node[flag], True))
    for value, _ in lower + upper:
        if type(value) not in (int, float):
            raise ValueError(f"json_schema bound at {path} must be a number; got {value!r}")
    return lower, upper


def int_bounds(node: dict[str, Any], path: str) -> tuple[int | None, int | None]:
    """The tightest integer [lo, hi] the node's bounds allow (None: unbounded)."""
    lower, upper = _bounds(node, path)
    lows = [math.floor(v) + 1 if excl else math.ceil(v) for v, excl in lower]
    highs = [math.ceil(v) - 1 if excl else math.floor(v) for v, excl in upper]
    return max(lows, default=None), min(highs, default=None)


def number_bounds(node: dict[str, Any], path: str) -> tuple[Bound | None, Bound | None]:
    """The tightest bounds of a number node; they must be integers to be enforced."""
    lower, upper = _bounds(node, path)
    if any(not float(v).is_integer() for v, _ in lower + upper):
        raise ValueError(f"json_schema number bounds at {path} must be integers to be enforced")
    lows = [Bound(int(v), excl) for v, excl in lower]
    highs = [Bound(int(v), excl) for v, excl in upper]
    lo = max(lows, key=lambda b: (b.value, b.exclusive), default=None)
    hi = min(highs, key=lambda b: (b.value, not b.exclusive), default=None)
    return lo, hi
