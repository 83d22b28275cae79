"""A tiny real checkpoint that thinks as Magistral does (`--reasoning-parser mistral`), scripted.

Its tokenizer is mistral_checkpoint.py's (Mistral's markers special tokens) with
`[THINK]`, `[/THINK]`, `[SYSTEM_PROMPT]` and `[/SYSTEM_PROMPT]` special too, and a chat
template of Magistral Small 2509's shape (`TEMPLATE`): a system prompt first, by default
one that asks for the thinking as `[THINK]...[/THINK]` and so spells both markers before
the conversation; then mistral_checkpoint.py's. Greedy, after a user message (`[/INST]`)
it thinks, then writes content and a v11 tool call:

    [THINK] alpha beta[/THINK] Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>

every marker a special token; after a tool result (`[/TOOL_RESULTS]`) it answers at once,
` gamma</s>`, without thinking. The weights are mistral_checkpoint.py's scripted ones.
"""

from __future__ import annotations

from pathlib import Path

from mistral_checkpoint import (
    ANSWER,
    ARGUMENTS,
    CONTENT,
    LAST_USER,
    MARKERS,
    TURNS,
    WORDS,
    add_mistral_tokens,
    write_script,
)

from sprig.runtime.tiny_checkpoint import build_tiny_checkpoint

THINKING_MARKERS = ["[THINK]", "[/THINK]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
THOUGHTS = [" alpha", " beta"]
REASONING = "alpha beta"
SUCCESSOR = {"[/INST]": "[THINK]", "[THINK]": THOUGHTS[0], THOUGHTS[0]: THOUGHTS[1], THOUGHTS[1]: "[/THINK]",
             "[/THINK]": CONTENT, CONTENT: "[TOOL_CALLS]", "[TOOL_CALLS]": "get_weather", "get_weather": "[ARGS]",
             "[ARGS]": ARGUMENTS, ARGUMENTS: "</s>", "[/TOOL_RESULTS]": ANSWER, ANSWER: "</s>"}
SCRIPT_TEXT = f"[THINK]{''.join(THOUGHTS)}[/THINK]{CONTENT}[TOOL_CALLS]get_weather[ARGS]{ARGUMENTS}"
DEFAULT_SYSTEM = "Think first, as [THINK]your thoughts[/THINK], then answer."
TEMPLATE = (
    LAST_USER + "{{- bos_token }}[SYSTEM_PROMPT]"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- else %}" + DEFAULT_SYSTEM + "{%- endif %}"
    "[/SYSTEM_PROMPT]" + TURNS
)


def build_magistral_checkpoint(path: Path) -> Path:
    build_tiny_checkpoint(path, "mistral")
    tok = add_mistral_tokens(path, [*MARKERS, *THINKING_MARKERS], [*WORDS, *THOUGHTS], TEMPLATE)
    script = list(SUCCESSOR)[1:10]
    assert tok.encode(SCRIPT_TEXT, add_special_tokens=False) == tok.convert_tokens_to_ids(script)
    return write_script(path, tok, SUCCESSOR)
