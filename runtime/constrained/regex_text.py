"""Regex text surgery done before compiling: refusing what a DFA cannot express (with a
message naming it), ASCII digits, literal escaping, and JSON-Schema `pattern`s rewritten
to match raw JSON string content.

All of it works on one lexer, `_atoms`, that splits a regex into escapes (`\\x`),
character classes (`[...]`, nested classes included) and single characters, so that a
rewrite never touches an escaped or in-class character by mistake.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# Characters a JSON string may not hold raw: the quote, the backslash, controls.
JSON_UNSAFE = '"\\\\\\x00-\\x1F'
_SAFE_ANY = f"[^{JSON_UNSAFE}]"
_METACHARS = set("\\.+*?()|[]{}^$#&-~")
# Escapes (or group openers) a DFA cannot do, and why.
_UNSUPPORTED = {
    "(?=": "lookahead",
    "(?!": "negative lookahead",
    "(?<=": "lookbehind",
    "(?<!": "negative lookbehind",
    "\\b": "word boundary \\b",
    "\\B": "non-word-boundary \\B",
    "\\<": "start-of-word \\<",
    "\\>": "end-of-word \\>",
    "\\k": "named backreference",
    "\\A": "anchor \\A",
    "\\z": "anchor \\z",
    "\\Z": "anchor \\Z",
    "^": "anchor ^",
    "$": "anchor $",
    **{f"\\{d}": f"backreference \\{d}" for d in "123456789"},
}
# Rewrites of class shorthands for JSON string content, outside a class (ECMA semantics:
# \w and \d are ASCII); \s keeps only the space, the one raw-legal ASCII blank.
_JSON_SHORTHANDS = {
    "\\d": "[0-9]",
    "\\w": "[0-9A-Za-z_]",
    "\\s": "[ ]",
    "\\D": f"[^0-9{JSON_UNSAFE}]",
    "\\W": f"[^0-9A-Za-z_{JSON_UNSAFE}]",
    "\\S": f"[^\\s{JSON_UNSAFE}]",
}


def _class_end(regex: str, start: int) -> int:
    """Index just past the class opening at `start`; a `]` first in a class is literal."""
    depth, i = 0, start
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            depth += 1
            i += 1
            i += regex.startswith("^", i)
            i += regex.startswith("]", i)
            continue
        i += 1
        if ch == "]":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"invalid regex {regex!r}: unterminated character class at {start}")


def _atoms(regex: str) -> Iterator[tuple[int, str]]:
    """(position, atom) pairs: an escape, a whole class, or one character."""
    i = 0
    while i < len(regex):
        ch = regex[i]
        end = _class_end(regex, i) if ch == "[" else i + (2 if ch == "\\" else 1)
        yield i, regex[i:end]
        i = end


def check_supported(regex: str) -> None:
    """Raise `ValueError` naming the first feature no DFA can express (lookarounds,
    backreferences, word boundaries, anchors: the whole output always matches)."""
    for pos, atom in _atoms(regex):
        probe = regex[pos : pos + 4] if atom == "(" else atom
        feature = next((v for k, v in _UNSUPPORTED.items() if probe.startswith(k)), None)
        if feature is not None:
            raise ValueError(
                f"unsupported regex feature in {regex!r}: {feature} at position {pos} "
                "(the whole output must match; lookarounds, backreferences, word "
                "boundaries and anchors cannot be compiled)"
            )


def ascii_digits(regex: str) -> str:
    """`\\d` → `[0-9]` (in a class: `0-9`): Rust's `\\d` admits every Unicode digit."""
    out = []
    for _, atom in _atoms(regex):
        if atom == "\\d":
            out.append("[0-9]")
        elif atom.startswith("["):
            out.append(re.sub(r"(?<!\\)((?:\\\\)*)\\d", r"\g<1>0-9", atom))
        else:
            out.append(atom)
    return "".join(out)


def escape_literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + ch if ch in _METACHARS else ch for ch in text)


def json_string_pattern(pattern: str) -> str:
    """A JSON-Schema `pattern` as a regex over a JSON string's raw content: a leading `^`
    and trailing `$` are dropped (the whole string will match: a subset of the unanchored
    pattern's strings), and `.`, negated classes and shorthands exclude the characters a
    JSON string must escape. Literals that need escaping remain: the caller checks."""
    atoms = [atom for _, atom in _atoms(pattern)]
    if atoms[:1] == ["^"]:
        atoms = atoms[1:]
    if atoms[-1:] == ["$"]:
        atoms = atoms[:-1]
    out = []
    for atom in atoms:
        if atom == ".":
            out.append(_SAFE_ANY)
        elif atom.startswith("[^"):
            rest = "\\" + atom[2:] if atom.startswith("[^]") else atom[2:]
            out.append(f"[^{JSON_UNSAFE}{rest}")
        else:
            out.append(_JSON_SHORTHANDS.get(atom, atom))
    return "".join(out)


def lark_grammar(regex: str) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are exactly `regex`'s matches:
    the regex as one terminal (`lark_terminal`). So an `ebnf` spec hands a regex to
    llguidance, whose lazy lexer compiles one of any JSON in milliseconds where a token
    automaton takes seconds."""
    return f"start: {lark_terminal(regex)}\n"


def lark_terminal(regex: str) -> str:
    """`regex` as a Lark regex terminal, `/.../`, with each unescaped `/` escaped and each
    newline written `\\n`."""
    out, i = [], 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            out.append("\\n" if regex[i + 1] == "\n" else regex[i : i + 2])
            i += 2
            continue
        out.append("\\n" if ch == "\n" else "\\/" if ch == "/" else ch)
        i += 1
    return "/" + "".join(out) + "/"


def text_without(word: str) -> str:
    """A regex of every text (newlines included) in which `word` does not occur; its
    first character must not occur again in it (so after a false start the search for
    `word` begins again at that character only). Each occurrence of the first character
    is followed by a proper prefix of the rest and then either the text's end, the first
    character again, or a character that breaks the prefix."""
    first, rest = word[0], word[1:]
    if not rest or first in rest:
        raise ValueError(f"text_without needs a word of two or more characters whose first does not recur: {word!r}")
    stops = [re.escape(rest[:j]) for j in range(len(rest))]
    breaks = [re.escape(rest[:j]) + _not_in(rest[j], first) + _not_in(first) + "*" for j in range(len(rest))]
    return f"{_not_in(first)}*(?:{re.escape(first)}(?:{'|'.join(stops + breaks)}))*"


def _not_in(*chars: str) -> str:
    """A character class of every character but `chars`."""
    return "[^" + "".join(_CLASS_ESCAPES.get(ch, ch) for ch in dict.fromkeys(chars)) + "]"


_CLASS_ESCAPES = {"\\": "\\\\", "]": "\\]", "[": "\\[", "^": "\\^", "-": "\\-", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
