"""The llguidance grammar backend: context-free grammars (SGLang's `ebnf`: GBNF, or Lark)
and the regexes of `spec_regex`, enforced by llguidance's Earley parser and lazy lexer
over the tokenizer's token trie.

llguidance's tokenizer and matchers are native objects that do not pickle, so the
backend carries what each token writes (`vocabulary.token_bytes`) and the fast tokenizer's
JSON, and builds its `LLTokenizer` once per process from them. Not from the JSON alone:
llguidance reads every added token as special, so a grammar could never produce
`</tool_call>` as the one token a Qwen or Hermes model writes for it; here an added token
that is not special is its text, as in the outlines backend.
A worker's `compile` checks a spec by building a matcher from it (a grammar too costly to
build runs out its time there, in a process that can be killed) and returns the
grammar's text; `prepare`, in the serving process, builds the template matcher that each
request's matcher is a copy of. Grammar text is only parsed, never executed; llguidance
bounds the parser's and the lexer's work per step (`LLParserLimits`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer

from sprig.runtime.constrained.base import (
    Grammar,
    GrammarSpec,
    bitmask_width,
    check_bitmask_row,
    forced_text,
)
from sprig.runtime.constrained.spec_regex import REGEX_KINDS, regex_error, spec_regex
from sprig.runtime.constrained.vocabulary import token_bytes

if TYPE_CHECKING:
    import torch

MAX_ERROR_CHARS = 500  # llguidance's messages quote the grammar; a client gets this much
MAX_TOKEN_BYTES = 1000  # llguidance's token trie panics on a token of 1,497 bytes (a BPE trained on code has one)

_tokenizers: dict[str, LLTokenizer] = {}  # fingerprint -> this process's LLTokenizer
_tokenizers_lock = threading.Lock()


def _limits() -> LLParserLimits:
    return LLParserLimits(verbose_errors=False)  # errors name the problem, not parser state


def _ebnf_grammar(spec: GrammarSpec) -> str:
    try:
        return llguidance.grammar_from("ebnf", spec.text)  # GBNF is converted; Lark passes
    except ValueError as e:
        raise ValueError(f"invalid ebnf grammar: {str(e)[:MAX_ERROR_CHARS]}") from None


def _regex_grammar(spec: GrammarSpec) -> str:
    return LLMatcher.grammar_from_regex(spec_regex(spec))


_GRAMMARS: dict[str, Callable[[GrammarSpec], str]] = {
    "ebnf": _ebnf_grammar,
    **dict.fromkeys(REGEX_KINDS, _regex_grammar),
}


@dataclass(frozen=True)
class GuidanceCompiled:
    """A spec as llguidance's grammar text, checked against the tokenizer `fingerprint`.
    `template` is set by `GuidanceBackend.prepare` in the serving process (it does not
    pickle) and never advanced: matchers are its copies."""

    spec: GrammarSpec
    grammar: str
    fingerprint: str
    template: LLMatcher | None = field(default=None, compare=False, repr=False)


class GuidanceGrammar(Grammar):
    """A request's matcher over an llguidance `LLMatcher` (see `Grammar` for invariants).

    Stop tokens never reach the matcher: a stop token is accepted here only where the
    matcher accepts, and ends the grammar. A token the matcher refuses leaves it as it
    was (`try_consume_tokens`). Should llguidance fail mid-way (a resource limit), only
    stop and EOS tokens are allowed, and each is refused, so the request ends with an
    error."""

    def __init__(self, matcher: LLMatcher, num_tokens: int, row_tokens: int, stop_token_ids: frozenset[int],
                 eos_token_ids: Iterable[int], max_rollback: int) -> None:
        """`num_tokens`: the ids llguidance masks; `row_tokens`: the ids a logits row has."""
        self.max_rollback = max_rollback
        self._m = matcher
        self._row_tokens = row_tokens
        self._words = bitmask_width(num_tokens)
        self._stops = stop_token_ids
        self._history: deque[tuple[int, bool]] = deque(maxlen=max_rollback)  # (token, is stop)
        self._stopped = False
        # (word, bit, is a stop token of this request) for the stops and llguidance's EOS
        special = sorted(stop_token_ids.union(eos_token_ids))
        self._stop_bits = [(t // 32, np.uint32(1 << (t % 32)), t in stop_token_ids) for t in special]

    def _final(self) -> bool:
        return self._m.is_accepting() and not self._m.is_error()

    def fill_bitmask(self, bitmask_row: torch.Tensor) -> None:
        row = bitmask_row
        check_bitmask_row(row, self._row_tokens)
        if self._stopped:
            row.zero_()
            return
        target = row if row.numel() == self._words else row.new_zeros(self._words)
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)
        if target is not row:
            row.zero_()
            row[: min(self._words, row.numel())] = target[: row.numel()]
        failed = self._m.is_error()
        if failed:
            row.zero_()
        final = self._final()
        words = row.numpy().view(np.uint32)  # shares the row's memory
        for word, bit, is_stop in self._stop_bits:  # failed: something to sample, then refuse
            if word < len(words):
                words[word] = words[word] | bit if failed or (final and is_stop) else words[word] & ~bit

    def accept_token(self, token_id: int) -> bool:
        if self._stopped:
            return False
        if token_id in self._stops:
            if not self._final():
                return False
            self._history.append((token_id, True))
            self._stopped = True
            return True
        if not 0 <= token_id < self._row_tokens or self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._history.append((token_id, False))
        return True

    def rollback(self, k: int) -> list[int]:
        if not 0 <= k <= len(self._history):
            raise ValueError(f"cannot roll back {k} tokens; {len(self._history)} can be")
        removed = [self._history.pop() for _ in range(k)][::-1]
        advanced = sum(not is_stop for _, is_stop in removed)
        if advanced and not self._m.rollback(advanced):
            raise RuntimeError(f"llguidance could not roll back {advanced} tokens: {self._m.get_error()}")
        if removed:
            self._stopped = False
        return [token_id for token_id, _ in removed]

    def is_terminated(self) -> bool:
        return self._stopped or self._final()

    def is_finished(self) -> bool:
        return self._stopped or (self._final() and self._m.is_stopped())

    def forced_continuation(self) -> str | None:
        if self._stopped or self._m.is_error():
            return None
        return forced_text(self._m.compute_ff_bytes())


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads: each token's bytes (a special token's
    its name; llguidance marks `special_token_ids` as such) and a text's token ids, in
    which a special token's name is text: llguidance tokenizes the text a grammar forces
    with it, and would otherwise allow the special token where a grammar spells its name
    (`<s>` in a regex), or nothing where that token is a stop."""

    def __init__(self, backend: GuidanceBackend) -> None:
        self.eos_token_id = backend.eos_token_id
        self.bos_token_id = None
        self.tokens = list(backend.tokens)
        self.special_token_ids = list(backend.special_ids)
        self._tokenizer = Tokenizer.from_str(backend.tokenizer_json)
        self._tokenizer.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


@dataclass(frozen=True)
class GuidanceBackend:
    """`GrammarBackend` over llguidance for one fast tokenizer (`tokenizer_json`, its
    serialized form; `tokens`, each id's bytes, with `special_ids` the ids a grammar never
    produces): llguidance masks `num_tokens` ids (at least the tokenizer's), logits rows
    hold `row_tokens`; ids the tokenizer lacks are never allowed."""

    tokenizer_json: str = field(repr=False)
    eos_token_id: int
    num_tokens: int
    row_tokens: int
    tokens: tuple[bytes, ...] = field(repr=False)
    special_ids: tuple[int, ...] = field(repr=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.sha256(b"llguidance:%d:%d:%d:" % (self.eos_token_id, self.num_tokens, self.row_tokens))
        digest.update(self.tokenizer_json.encode())
        object.__setattr__(self, "fingerprint", digest.hexdigest())

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, logits_width: int | None = None) -> GuidanceBackend:
        """Raises `ValueError` for a tokenizer without EOS or not backed by `tokenizers`."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the llguidance backend needs a fast (tokenizers) tokenizer")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; constrained decoding needs one")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        size = max(len(tokenizer), backend.get_vocab_size(with_added_tokens=True))
        rows = size if logits_width is None else logits_width
        num_tokens = max(size, rows)
        written = token_bytes(tokenizer)
        written += (None,) * (num_tokens - len(written))
        # a token that writes nothing (special, an id the vocabulary skips or lacks) is special to
        # llguidance, named as its own tokenizers name theirs (0xFF, then the name); so is one too
        # long for its token trie (named by its id), which a grammar then never produces
        silent = [i for i, data in enumerate(written) if data is None and i < size]
        names = dict(zip(silent, tokenizer.convert_ids_to_tokens(silent), strict=True))
        tokens = tuple(data if data is not None and len(data) <= MAX_TOKEN_BYTES
                       else b"\xff" + (names.get(i) if data is None and names.get(i) else f"<[{i}]>").encode()
                       for i, data in enumerate(written))
        special = tuple(i for i, data in enumerate(written) if data is None or len(data) > MAX_TOKEN_BYTES)
        return cls(backend.to_str(), tokenizer.eos_token_id, num_tokens, rows, tokens, special)

    def tokenizer(self) -> LLTokenizer:
        """This process's `LLTokenizer` (built on first use: a second or so for a large
        vocabulary)."""
        with _tokenizers_lock:
            tok = _tokenizers.get(self.fingerprint)
            if tok is None:
                tok = LLTokenizer(TokenizerWrapper(_Vocabulary(self)), n_vocab=self.num_tokens,
                                  eos_token=self.eos_token_id)
                _tokenizers[self.fingerprint] = tok
            return tok

    def _new_matcher(self, spec: GrammarSpec, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            message = matcher.get_error().strip()[:MAX_ERROR_CHARS]
            if spec.kind in REGEX_KINDS:
                raise regex_error(spec_regex(spec), message)
            raise ValueError(f"cannot compile the {spec.kind} grammar: {message}")
        return matcher

    def compile(self, spec: GrammarSpec) -> GuidanceCompiled:
        grammar = _GRAMMARS[spec.kind](spec)
        self._new_matcher(spec, grammar)
        return GuidanceCompiled(spec, grammar, self.fingerprint)

    def prepare(self, compiled: GuidanceCompiled) -> GuidanceCompiled:
        return dataclasses.replace(compiled, template=self._new_matcher(compiled.spec, compiled.grammar))

    def matcher(
        self,
        compiled: GuidanceCompiled,
        *,
        stop_token_ids: Iterable[int] | None = None,
        max_rollback: int = 64,
    ) -> GuidanceGrammar:
        """A fresh matcher (a copy of the prepared template; built here if `compiled` was
        not prepared); `stop_token_ids` defaults to the tokenizer's EOS."""
        if compiled.fingerprint != self.fingerprint:
            raise ValueError("grammar was compiled for a different tokenizer")
        template = compiled.template or self._new_matcher(compiled.spec, compiled.grammar)
        stops = frozenset(stop_token_ids if stop_token_ids is not None else {self.eos_token_id})
        eos = self.tokenizer().eos_tokens
        return GuidanceGrammar(template.deep_copy(), self.num_tokens, self.row_tokens, stops, eos, max_rollback)
