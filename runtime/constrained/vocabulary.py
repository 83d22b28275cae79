"""Token ids → the exact bytes each contributes to the output, built offline from an HF
tokenizer (outlines-core's `Vocabulary.from_pretrained` needs a hub).

Byte-level BPE symbols go through the inverse of GPT-2's byte↔unicode table; `<0xNN>`
byte-fallback pieces become byte NN and SentencePiece's `▁` a space; added non-special
tokens are their literal text. Special tokens (EOS included; `special_token_ids`) get no
bytes: a grammar can never produce them (decoding drops them), stop tokens are handled by
the matcher.

The end mark: every regex is compiled as `marked(regex)` = `(?:regex)END_MARK`, and both
vocabularies hold one extra token for END_MARK (an id no model produces). "The output
may end here" is then "the mark token is allowed here", and no state short of the end is
final in the automaton. That matters: outlines-core 0.2.14's `Index` drops a token's
transition out of a final state when the token's next-to-last position is a match and it
ends short of one (regex-automata reports matches one byte late), e.g. "." after "1" in
`[0-9]+(.[0-9]+)?`, or "a" at the start of `(ab)?`. So that no real token can spell the
mark, tokens ending in a prefix of its bytes are left out of the token index: outputs
never hold a character of plane 16 (private use, lead byte F4) split that way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outlines_core import Vocabulary

END_MARK = "\U0010fffd"
BYTE_EOS = 256  # the EOS id of `byte_vocabulary()`
BYTE_MARK = 257  # the END_MARK token of `byte_vocabulary()`
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the
    other bytes were shifted to code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if chr(b) not in table)
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


@functools.cache
def _byte_level_tables() -> tuple[re.Pattern[str], dict[int, int]]:
    """A pattern that finds a character outside the byte-level alphabet, and the
    `str.translate` table that turns each alphabet character into the character of its
    byte (so that latin-1 encodes it to that byte)."""
    table = _unicode_to_byte()
    outside = re.compile("[^" + "".join(re.escape(ch) for ch in table) + "]")
    return outside, {ord(ch): b for ch, b in table.items()}


def _byte_level(piece: str) -> bytes:
    outside, to_bytes = _byte_level_tables()
    if outside.search(piece):
        return piece.encode()
    return piece.translate(to_bytes).encode("latin-1")


def _sentencepiece(piece: str) -> bytes:
    match = _BYTE_FALLBACK.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace("▁", " ").encode()


_PIECE_DECODERS: dict[str, Callable[[str], bytes]] = {
    "byte_level": _byte_level,
    "sentencepiece": _sentencepiece,
    "plain": str.encode,
}
# The tokenizers decoder types that decide the family; the first one present wins.
_FAMILY_BY_DECODER = (
    ("ByteLevel", "byte_level"),
    ("ByteFallback", "sentencepiece"),
    ("Metaspace", "sentencepiece"),
    ("Replace", "sentencepiece"),
)


def _decoder_types(node: Any) -> set[str]:
    if isinstance(node, dict):
        own = {node["type"]} if isinstance(node.get("type"), str) else set()
        return own.union(*(_decoder_types(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_decoder_types(v) for v in node))
    return set()


def tokenizer_family(tokenizer: Any) -> str:
    """One of "byte_level", "sentencepiece", "plain", read from the fast tokenizer's decoder
    (a tokenizer without one is assumed SentencePiece, the usual slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "sentencepiece"
    types = _decoder_types(json.loads(backend.to_str()).get("decoder"))
    return next((family for name, family in _FAMILY_BY_DECODER if name in types), "plain")


def marked(regex: str) -> str:
    """The regex every `Index` is built from (see the module docstring)."""
    return f"(?:{regex}){END_MARK}"


@dataclass(frozen=True)
class TokenVocabulary:
    """`token_bytes[i]` is what token i appends to the output, or None when a grammar must
    never choose it (special tokens, empty tokens); tokens that could spell END_MARK are
    left out of `outlines`. Ids >= len(token_bytes) do not exist. `fingerprint` is a hash of (eos, every id's bytes):
    equal fingerprints, equal grammars. `outlines` also maps END_MARK to `mark_id`.
    """

    token_bytes: tuple[bytes | None, ...]
    eos_token_id: int
    fingerprint: str = field(init=False)
    mark_id: int = field(init=False)
    outlines: Vocabulary = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(str(self.eos_token_id).encode())
        for token_id, data in enumerate(self.token_bytes):
            if data is not None:
                digest.update(b"%d:%d:" % (token_id, len(data)) + data)
        object.__setattr__(self, "fingerprint", digest.hexdigest())
        mark_id = max(len(self.token_bytes), self.eos_token_id + 1)
        object.__setattr__(self, "mark_id", mark_id)
        mark = END_MARK.encode()
        spells_mark = tuple(mark[:n] for n in range(1, len(mark) + 1))
        by_bytes: dict[bytes, list[int]] = {mark: [mark_id]}
        for token_id, data in enumerate(self.token_bytes):
            if data and not data.endswith(spells_mark) and token_id != self.eos_token_id:
                by_bytes.setdefault(data, []).append(token_id)
        object.__setattr__(self, "outlines", Vocabulary(self.eos_token_id, by_bytes))

    def __len__(self) -> int:
        return len(self.token_bytes)


def build_vocabulary(tokenizer: Any, *, logits_width: int | None = None) -> TokenVocabulary:
    """Read every token of an HF tokenizer; ids >= `logits_width` (the model's logits
    row, which may be narrower or wider than the tokenizer) are dropped."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; constrained decoding needs one")
    return TokenVocabulary(token_bytes(tokenizer, logits_width=logits_width), eos)


def token_bytes(tokenizer: Any, *, logits_width: int | None = None) -> tuple[bytes | None, ...]:
    """What each token id of an HF tokenizer appends to the output (`TokenVocabulary`'s
    `token_bytes`): None for special and empty tokens and for ids it lacks; ids from
    `logits_width` on dropped. Read once per tokenizer object (both grammar backends and
    each constraint trigger ask; half a second for 100k tokens)."""
    written = _TOKEN_BYTES.get(tokenizer)
    if written is None:
        written = _TOKEN_BYTES[tokenizer] = _read_token_bytes(tokenizer)
    return written if logits_width is None else written[:logits_width]


_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, tuple[bytes | None, ...]] = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens decoding drops (`skip_special_tokens`): those the tokenizer names
    (`all_special_ids`) and every added token flagged special, which its special tokens
    map need not list (Llama 3's `<|python_tag|>`, gpt-oss's harmony markers)."""
    flagged = (i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    return frozenset(tokenizer.all_special_ids).union(flagged)


def _read_token_bytes(tokenizer: Any) -> tuple[bytes | None, ...]:
    decode = _PIECE_DECODERS[tokenizer_family(tokenizer)]
    special = special_token_ids(tokenizer)
    added = {i: text for text, i in tokenizer.get_added_vocab().items()}
    pieces = tokenizer.get_vocab()
    out: list[bytes | None] = [None] * (max(pieces.values()) + 1)
    for piece, token_id in pieces.items():
        if token_id not in special:
            out[token_id] = (added[token_id].encode() if token_id in added else decode(piece)) or None
    return tuple(out)


@functools.cache
def byte_vocabulary() -> Vocabulary:
    """One token per byte value (id = the byte), EOS `BYTE_EOS`, END_MARK `BYTE_MARK`:
    over it an outlines `Index` of a marked regex is the regex's byte-level automaton."""
    return Vocabulary(
        BYTE_EOS, {bytes([b]): [b] for b in range(256)} | {END_MARK.encode(): [BYTE_MARK]}
    )
