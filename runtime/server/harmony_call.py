"""One chat request on a model that writes harmony (gpt-oss; the format is read in
`harmony`): what its prompt ends with, the sampling parameters that keep the format's
markers in its text and defer its constraint, and how its output reads.

- The markers are special tokens, which decoding drops by default (`skip_special_tokens`):
  a harmony request is decoded with them kept, whatever the request says, and the reader
  keeps them out of what the client sees. `/generate` and `/v1/completions` decode as asked.
- A constraint (`response_format`, `regex`, ...) holds the final channel's text: the
  scheduler's reasoning gate (`SamplingParams.reasoning_end`) lets the model write freely
  (analysis, preambles) until `<|channel|>final<|message|>`, then hands the answer to the
  grammar; a prompt that already ends inside the final channel constrains from the start.
  With `tool_choice` "auto" (the request's functions read as calls) the output may
  instead end with a call: `<|call|>` is the gate's one exit
  (`SamplingParams.reasoning_exits`), the only stop token allowed before the final
  channel, so a client may give tools and `response_format` at once (as the OpenAI
  Agents SDK does for an agent with tools and a structured output). The call's
  arguments are not held to its schema there.
- A forced call (`tool_choice` "required", or a named function): where the server compiles
  Lark grammars in llguidance (`context_free`), which writes special tokens by name, a
  grammar holds the whole turn (`calls_grammar`): any analysis and preamble messages, then
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` for one of the
  allowed functions, then arguments valid against that function's schema. Otherwise the
  server writes the header of the one allowed function into the prompt and a regex holds
  the arguments (the model then skips its analysis); with several functions to choose
  from the name would sit between special tokens, so that is refused.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from sprig.runtime.constrained.regex_text import lark_terminal
from sprig.runtime.sampling.params import MAX_EBNF_CHARS
from sprig.runtime.server.answer_decoding import KEEP_MARKERS
from sprig.runtime.server.config import HARMONY
from sprig.runtime.server.constraints import Constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FINAL,
    FUNCTIONS,
    MESSAGE,
    START,
    HarmonyReader,
    Message,
    opening,
    speaks_harmony,
)
from sprig.runtime.server.tool_calls import ToolUse, arguments_regex

GENERATION_PROMPT = "assistant"  # the header the chat template's generation prompt leaves open


@dataclass(frozen=True)
class HarmonyServing:
    """A server whose chat model writes harmony. `reasoning`: the analysis channel is
    split off as `reasoning_content` (`--reasoning-parser gpt-oss`); `calls`: messages to
    the request's functions are tool calls (`--tool-call-parser gpt-oss`, or "auto")."""

    reasoning: bool
    calls: bool

    @classmethod
    def of(cls, reasoning_parser: str | None, tool_call_parser: str,
           chat_template: str | None) -> HarmonyServing | None:
        """The server's harmony reading, if either parser names it or, with neither set
        otherwise, its chat template writes harmony (`tool_call_parser` "auto")."""
        named = HARMONY in (reasoning_parser, tool_call_parser)
        detected = tool_call_parser == "auto" and reasoning_parser is None and speaks_harmony(chat_template)
        if not (named or detected):
            return None
        return cls(reasoning=reasoning_parser == HARMONY, calls=tool_call_parser in ("auto", HARMONY))

    def turn(self, prompt: str, tools: ToolUse, constraint: Constraint | None, separate_reasoning: bool,
             context_free: bool) -> HarmonyTurn:
        """The request whose rendered prompt is `prompt` and whose tools are planned
        (`plan_tool_use`, with no text format). Raises ApiError for what harmony cannot
        constrain (see the module docstring)."""
        reader = HarmonyReader(opening(prompt), self.reasoning and separate_reasoning,
                               tools.names if self.calls or tools.forced else frozenset())
        sampling: dict[str, Any] = dict(KEEP_MARKERS)
        if tools.forced and context_free:
            _check_generation_prompt(prompt)
            sampling["ebnf"] = calls_grammar([t for t in tools.rendered or () if t["function"]["name"] in tools.names])
            tools = dataclasses.replace(tools, regex=None, trigger=None)
        elif tools.forced:
            prompt, tools = _forced(prompt, tools)
            reader = dataclasses.replace(reader, opened=opening(prompt))
        elif constraint is not None and not _in_final(reader.opened):
            sampling["reasoning_end"] = FINAL
            if self.calls and tools.rendered:
                sampling["reasoning_exits"] = [CALL]
        grammar = {k: v for k, v in tools.grammar_params(context_free).items() if v is not None}
        return HarmonyTurn(prompt, tools, reader, sampling | grammar)


@dataclass(frozen=True)
class HarmonyTurn:
    """One request as sent: its `prompt` (a forced call's header appended), its `tools`
    (a forced call's regex that of its arguments), how its output reads, and the sampling
    parameters the server adds."""

    prompt: str
    tools: ToolUse
    reader: HarmonyReader
    sampling: dict[str, Any]


def calls_grammar(tools: list[dict[str, Any]]) -> str:
    """The Lark grammar (llguidance's, special tokens by name) of an assistant turn that
    ends in a call of one of `tools`: analysis and preamble messages, any number, then the
    call's header and its arguments, valid against the function's parameter schema. The
    stop token (`<|call|>`) is the matcher's, allowed once the arguments are complete.
    Raises ApiError (400 naming `tools`) for a schema the constrained decoder cannot
    enforce."""
    lines = [
        "start: message* call",
        f'message: {CHANNEL} ("analysis" | "commentary") {MESSAGE} TEXT {END} {START} "{GENERATION_PROMPT}"',
        "TEXT: /(?s:.*)/",
        f"call: {CHANNEL} " + json.dumps(f"commentary to={FUNCTIONS}") + " ("
        + " | ".join(f"call{i}" for i in range(len(tools))) + ")",
    ]
    for i, tool in enumerate(tools):
        name = json.dumps(tool["function"]["name"] + " ", ensure_ascii=False)
        lines.append(f'call{i}: {name} {CONSTRAIN} "json" {MESSAGE} ARGS{i}')
        lines.append(f"ARGS{i}: {lark_terminal(arguments_regex(tool))}")
    grammar = "\n".join(lines) + "\n"
    if len(grammar) > MAX_EBNF_CHARS:
        raise ApiError(400, f"the grammar of a call to these tools is {len(grammar)} characters, more than "
                            f"{MAX_EBNF_CHARS}: force fewer tools or smaller schemas", "tools")
    return grammar


def _check_generation_prompt(prompt: str) -> None:
    if opening(prompt).strip() != GENERATION_PROMPT:
        raise ApiError(400, "a forced tool call needs the assistant's generation prompt (not "
                            "continue_final_message or add_generation_prompt: false)", "tool_choice")


def _forced(prompt: str, tools: ToolUse) -> tuple[str, ToolUse]:
    """The prompt with the forced call's header written, and the call's tool use with the
    regex of its arguments (a server that compiles no Lark grammar)."""
    if len(tools.names) != 1:
        raise ApiError(400, "a harmony (gpt-oss) model can be made to call one of several functions only where "
                            "the server compiles Lark grammars (a fast tokenizer with an EOS): the name sits "
                            "between special tokens; name the function "
                            '({"type": "function", "function": {"name": ...}}) or give one tool', "tool_choice")
    _check_generation_prompt(prompt)
    [name] = tools.names
    [tool] = [t for t in tools.rendered or () if t["function"]["name"] == name][:1]
    header = f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"
    return prompt + header, dataclasses.replace(tools, regex=arguments_regex(tool), trigger=None)


def _in_final(opened: str) -> bool:
    """Whether the output continues a final-channel body the prompt opened."""
    return opened.endswith(MESSAGE) and Message(opened, "", False).channel == "final"
