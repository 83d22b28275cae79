"""Every tool-call format the server reads (`TOOL_FORMATS`: the JSON ones of `tool_calls`
and Qwen3-Coder's XML-like one of `xml_tool_calls`), and the one a server uses: named
by `--tool-call-parser`, or found in its chat template's text."""

from __future__ import annotations

from sprig.runtime.server.config import HARMONY
from sprig.runtime.server.tool_calls import FORMATS, CallFormat
from sprig.runtime.server.xml_tool_calls import XmlToolFormat

TOOL_FORMATS: dict[str, CallFormat] = {**FORMATS, "qwen3_coder": XmlToolFormat()}


def detect_format(chat_template: str | None) -> CallFormat | None:
    """The format a chat template teaches, from the markers it writes; None if none.
    Qwen3-Coder's template writes `<tool_call>` too, so its `<function=` and
    `<parameter=` are looked for first."""
    text = chat_template or ""
    if "<function=" in text and "<parameter=" in text:
        return TOOL_FORMATS["qwen3_coder"]
    if "<tool_call>" in text:
        return TOOL_FORMATS["hermes"]
    if "[TOOL_CALLS]" in text:
        return TOOL_FORMATS["mistral"]
    if "<|python_tag|>" in text:
        return TOOL_FORMATS["llama3"]
    return None


def resolve_format(choice: str, chat_template: str | None) -> CallFormat | None:
    """The format for a server's `tool_call_parser` setting ("auto": `detect_format`;
    None for "none", and for harmony's "gpt-oss", read as whole messages by `server.harmony`
    and picked from a template by `harmony_call.HarmonyServing.of`)."""
    if choice in ("none", HARMONY):
        return None
    if choice == "auto":
        return detect_format(chat_template)
    return TOOL_FORMATS[choice]
