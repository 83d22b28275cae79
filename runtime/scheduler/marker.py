"""A text watched for in a request's free output (a constraint trigger, a reasoning end
marker), read against one tokenizer once: which tokens can complete it and run on past
it in the same token. Those are the only tokens that can leave text for the grammar the
marker starts, so they are the only ones a gate must check before allowing them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sprig.runtime.constrained.vocabulary import special_token_ids, token_bytes


@dataclass(frozen=True)
class Marker:
    """`completing[j]` for j >= 1: the tokens whose text starts with `text[j:]` and runs on
    past it (they complete the marker after an output ending in `text[:j]`);
    `completing[0]`: the tokens that hold all of `text` with more after it.

    `names_written`: the output is decoded with special tokens written as their names
    (a reasoning marker may be made of them, as harmony's `<|channel|>final<|message|>`);
    otherwise special tokens write no text, and those whose name is `text` (`named`) are
    the marker by themselves. `special`: the tokens that write no text."""

    text: str
    completing: tuple[tuple[int, ...], ...]
    special: frozenset[int]
    named: frozenset[int]
    names_written: bool

    @classmethod
    def build(cls, tokenizer: Any, text: str, *, names_written: bool = False) -> Marker:
        if not text:
            raise ValueError("a marker must not be empty")
        whole, last = text.encode(), text.encode()[-1:]
        suffixes = [text[j:].encode() for j in range(len(text))]
        found: list[list[int]] = [[] for _ in text]
        written = list(token_bytes(tokenizer))
        special = [i for i, data in enumerate(written) if data is None]
        names = tokenizer.convert_ids_to_tokens(special)
        named = [i for i, name in zip(special, names, strict=True) if name == text]
        if names_written:
            named_ids = special_token_ids(tokenizer)
            for i, name in zip(special, names, strict=True):
                if i in named_ids and name:
                    written[i] = name.encode()
            special, named = [i for i in special if written[i] is None], []
        for token_id, data in enumerate(written):
            if data is None or last not in data[:-1]:  # every such token holds the last byte, then more
                continue
            at = data.find(whole)
            if at >= 0 and at + len(whole) < len(data):
                found[0].append(token_id)
            for j in range(1, len(text)):
                if len(data) > len(suffixes[j]) and data.startswith(suffixes[j]):
                    found[j].append(token_id)
        return cls(text, tuple(tuple(ids) for ids in found), frozenset(special), frozenset(named), names_written)

    @property
    def window(self) -> int:
        """Tokens decoded to look for the marker: every token holds at least one of its
        characters, plus one for a character split across tokens."""
        return len(self.text) + 1

    def decode(self, tokenizer: Any, ids: tuple[int, ...]) -> str:
        """The text of `ids` as the marker is looked for in it."""
        return tokenizer.decode(list(ids), skip_special_tokens=not self.names_written) if ids else ""
