"""OpenAI's harmony format (gpt-oss), read into OpenAI's assistant message.

A completion is a sequence of messages, each a header and a body between special tokens:

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

The header (after `<|start|>`, up to `<|message|>`) holds the role, the channel after
`<|channel|>`, the recipient `to=...` (before or after the channel) and the content type
(`json`, or `<|constrain|>json`). The body ends at `<|end|>`, `<|return|>`, `<|call|>` or
`<|endoftext|>`, or where the next header begins (a model may skip the end marker). The
prompt ends inside the first header (`<|start|>assistant`): what it leaves open
(`opening`) is read as the beginning of the output.

What each message becomes:
- a message to `functions.NAME`, NAME among the request's tools: a tool call whose
  arguments are its body as written; the header names the call before its arguments
  begin, so a call streams as it is written (id and name, then the arguments in pieces);
- on the analysis channel: reasoning (content when the reasoning is not split off);
- anything else: content (the final channel, commentary preambles, and, as for the other
  tool-call formats, a call of a function the request did not give, or of a built-in tool).
Bodies of one kind are joined with "\\n". A finished output with no marker at all (a model
that does not write harmony) is plain content.

Invariant of `HarmonyReader.read`: while the output is unfinished, the reasoning and the
content it returns are prefixes of what it returns later, calls are only added, and each
call's arguments are a prefix of its later arguments; no marker, nor the beginning of one,
is ever part of them (text that may yet turn out to begin a marker is held back).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL, END_OF_TEXT = "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>"
CLOSERS = (END, RETURN, CALL, END_OF_TEXT)
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *CLOSERS)
FINAL = CHANNEL + "final" + MESSAGE  # what opens the answer: where a constraint starts
FUNCTIONS = "functions."  # the namespace of the request's tools
_PIECES = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_DECODER = json.JSONDecoder()


def speaks_harmony(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): its markers are in its text."""
    return CHANNEL in (chat_template or "") and START in (chat_template or "")


def opening(prompt: str) -> str:
    """The header the prompt leaves open for the output (`assistant` after the generation
    prompt; a whole header, up to `<|message|>`, when the prompt ends inside a body: a
    continued final message, or a call the server began); "" when it ends between
    messages. The body the prompt holds is not part of it: only what the output adds is read."""
    at = prompt.rfind(START)
    if at < 0:
        return ""
    tail = prompt[at + len(START) :]
    if any(closer in tail for closer in CLOSERS):
        return ""
    body = tail.find(MESSAGE)
    return tail if body < 0 else tail[: body + len(MESSAGE)]


@dataclass(frozen=True)
class Message:
    """One message of an output: `header` its text (markers in it kept), `body` as far as
    it is written, `closed` once an end marker or the next header ended it."""

    header: str
    body: str
    closed: bool

    @property
    def channel(self) -> str | None:
        found = _CHANNEL.search(self.header)
        return found[1] if found else None

    @property
    def recipient(self) -> str | None:
        found = _RECIPIENT.search(self.header)
        return found[1] if found else None


def messages(opened: str, text: str, finished: bool) -> list[Message]:
    """The messages of the output `text`, read after the header `opened` (`opening`):
    each whose header is complete, the last one possibly still open. Unfinished, a tail
    of `text` that may begin a marker is left out; text between messages is a message
    of its own, without a header, once it holds more than blanks."""
    if not finished:
        text = text[: len(text) - _partial_marker(text)]
    out: list[Message] = []
    header: str | None = opened if opened else None  # None: between messages
    body: str | None = None  # None: not in a body
    if header is not None and header.endswith(MESSAGE):
        header, body = header[: -len(MESSAGE)], ""

    def close() -> None:
        nonlocal header, body
        if body is not None and (header or body.strip()):
            out.append(Message(header or "", body, True))
        header, body = None, None

    for piece in _PIECES.split(text):
        if piece == START:
            close()
            header = ""
        elif piece == CHANNEL and (body is not None or header is None):  # a header without <|start|>
            close()
            header = piece
        elif piece == MESSAGE and header is not None and body is None:
            body = ""
        elif piece in CLOSERS:
            close()
        elif piece in MARKERS:
            if body is None and header is not None:
                header += piece
        elif body is not None:
            body += piece
        elif header is not None:
            header += piece
        elif piece:  # text between messages
            header, body = "", piece
    if body is not None and (header or body.strip()):
        out.append(Message(header or "", body, False))
    return out


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that begins a marker."""
    return max((k for m in MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)


@dataclass(frozen=True)
class Reading:
    """An output read as OpenAI's assistant message: `reasoning` (None when it has none),
    `content`, and each call as (name, arguments as written so far, whether complete)."""

    reasoning: str | None
    content: str
    calls: list[tuple[str, str, bool]] = field(default_factory=list)


@dataclass(frozen=True)
class HarmonyReader:
    """How one request's output reads: after the header `opened` (`opening`), with the
    analysis channel split off as reasoning (`split_reasoning`) and calls of the
    functions `names` (empty: no call; those messages are then content)."""

    opened: str = ""
    split_reasoning: bool = True
    names: frozenset[str] = frozenset()

    def read(self, text: str, finished: bool) -> Reading:
        """The output so far (see the module docstring for what becomes what). A call is
        complete once its message is closed, or, in a finished output, once its arguments
        are a whole JSON value (a constrained call ends where its grammar does)."""
        if finished and not self.opened.endswith(MESSAGE) and not any(m in text for m in MARKERS):
            return Reading(None, text)
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[tuple[str, str, bool]] = []
        for m in messages(self.opened, text, finished):
            recipient = m.recipient or ""
            name = recipient.removeprefix(FUNCTIONS)
            if recipient.startswith(FUNCTIONS) and name in self.names:
                calls.append((name, m.body, m.closed or (finished and _whole_json(m.body))))
            elif m.channel == "analysis" and self.split_reasoning:
                reasoning.append(m.body)
            else:
                content.append(m.body)
        return Reading(_joined(reasoning) if reasoning else None, _joined(content), calls)


def _joined(bodies: list[str]) -> str:
    """Bodies of one kind as one text: the non-empty ones joined with newlines (an empty
    body adds nothing, so an open body that is still empty adds no separator)."""
    return "\n".join(b for b in bodies if b)


def _whole_json(text: str) -> bool:
    try:
        end = _DECODER.raw_decode(text, len(text) - len(text.lstrip()))[1]
    except (ValueError, RecursionError):
        return False
    return not text[end:].strip()
