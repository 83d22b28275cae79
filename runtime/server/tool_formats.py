"""Every tool-call format the server reads (`TOOL_FORMATS`: the JSON ones of `tool_calls`,
Qwen3-Coder's XML-like one of `xml_tool_calls` and Mistral's v11 one of
`mistral_tool_calls`), and the one a server uses: named by `--tool-call-parser`, or found
in its chat template's text.

Mistral's two formats go by one name, as in vLLM and SGLang: "mistral" reads the v11
format (`[TOOL_CALLS]NAME[ARGS]{...}`) where the chat template writes `[ARGS]`, and the
older JSON list (`[TOOL_CALLS] [{...}]`) otherwise, unless the tokenizer has an `[ARGS]`
token; "mistral_v11" names the newer one outright. Its markers are special tokens, so
`answer_decoding` decides how its answers are decoded."""

from __future__ import annotations

from collections.abc import Container

from sprig.runtime.server.config import HARMONY
from sprig.runtime.server.mistral_tool_calls import ARGS, MistralToolFormat
from sprig.runtime.server.tool_calls import FORMATS, CallFormat
from sprig.runtime.server.xml_tool_calls import XmlToolFormat

TOOL_FORMATS: dict[str, CallFormat] = {**FORMATS, "qwen3_coder": XmlToolFormat(), "mistral_v11": MistralToolFormat()}


def detect_format(chat_template: str | None) -> CallFormat | None:
    """The format a chat template teaches, from the markers it writes; None if none.
    Qwen3-Coder's template writes `<tool_call>` too, so its `<function=` and
    `<parameter=` are looked for first; Mistral's v11 template writes `[TOOL_CALLS]`
    and `[ARGS]`, the older one `[TOOL_CALLS]` alone."""
    text = chat_template or ""
    if "<function=" in text and "<parameter=" in text:
        return TOOL_FORMATS["qwen3_coder"]
    if "<tool_call>" in text:
        return TOOL_FORMATS["hermes"]
    if "[TOOL_CALLS]" in text:
        return TOOL_FORMATS["mistral_v11" if ARGS in text else "mistral"]
    if "<|python_tag|>" in text:
        return TOOL_FORMATS["llama3"]
    return None


def resolve_format(choice: str, chat_template: str | None, vocabulary: Container[str] = ()) -> CallFormat | None:
    """The format for a server's `tool_call_parser` setting ("auto": `detect_format`;
    "mistral": the v11 format where the template writes `[ARGS]` or the tokenizer's
    `vocabulary` has it; None for "none", and for harmony's "gpt-oss", read as whole
    messages by `server.harmony` and picked from a template by
    `harmony_call.HarmonyServing.of`)."""
    if choice in ("none", HARMONY):
        return None
    if choice == "auto":
        return detect_format(chat_template)
    if choice == "mistral" and (ARGS in (chat_template or "") or ARGS in vocabulary):
        return TOOL_FORMATS["mistral_v11"]
    return TOOL_FORMATS[choice]
