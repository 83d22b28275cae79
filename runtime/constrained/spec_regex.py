"""The regex a regex, JSON-schema or choices spec stands for: the one language both
regex-driven backends compile, so they enforce exactly the same outputs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from sprig.runtime.constrained.base import GrammarSpec
from sprig.runtime.constrained.json_schema import schema_to_regex
from sprig.runtime.constrained.regex_text import ascii_digits, check_supported, escape_literal


def _user_regex(spec: GrammarSpec) -> str:
    check_supported(spec.text)
    return spec.text


def _choices_regex(spec: GrammarSpec) -> str:
    options = json.loads(spec.text)
    if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
        raise ValueError("choices must be a non-empty list of strings")
    return "(?:" + "|".join(escape_literal(o) for o in options) + ")"


_TO_REGEX: dict[str, Callable[[GrammarSpec], str]] = {
    "regex": _user_regex,
    "json_schema": lambda spec: schema_to_regex(spec.text, spec.whitespace),
    "choices": _choices_regex,
}
REGEX_KINDS = frozenset(_TO_REGEX)


def spec_regex(spec: GrammarSpec) -> str:
    """The whole output must match the returned regex (ASCII `\\d`). Raises `ValueError`
    naming the problem for an invalid spec, or one of a kind no regex expresses."""
    convert = _TO_REGEX.get(spec.kind)
    if convert is None:
        raise ValueError(f"a {spec.kind} grammar is not a regular language; it needs a grammar backend")
    return ascii_digits(convert(spec))


def regex_error(regex: str, detail: str) -> ValueError:
    """The error for a regex a backend failed to compile, saying why in Python's words
    where Python finds it invalid (backends name syntax errors less clearly)."""
    try:
        re.compile(regex)
    except re.error as py_error:
        detail = str(py_error)
    shown = regex if len(regex) <= 200 else regex[:200] + "..."
    return ValueError(f"cannot compile regex {shown!r}: {detail}")
