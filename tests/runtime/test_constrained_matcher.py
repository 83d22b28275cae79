"""The per-request matcher of each backend: forced continuations and jump-forward,
rollback, atomic acceptance, the end-of-output rules, and invalid specs failing with a
named ValueError."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sprig.kernels.logit_mask import unpack_bitmask
from sprig.runtime.constrained import (
    GrammarBackend,
    GrammarSpec,
    GuidanceBackend,
    OutlinesBackend,
    TokenVocabulary,
    bitmask_width,
    spec_from_params,
)
from sprig.runtime.sampling.params import SamplingParams
from sprig.runtime.tiny_checkpoint import build_tokenizer

EOS = 2
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module", params=[OutlinesBackend, GuidanceBackend])
def backend(request, tokenizer) -> GrammarBackend:
    return request.param.from_tokenizer(tokenizer)


def mask(grammar, width: int) -> torch.Tensor:  # [width] bool
    row = torch.zeros(bitmask_width(width), dtype=torch.int32)
    grammar.fill_bitmask(row)
    return unpack_bitmask(row[None], width)[0]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_forced_continuation_and_jump_forward(backend, tokenizer):
    grammar = backend.matcher(backend.compile(GrammarSpec.json_schema(PERSON, whitespace="")))
    assert grammar.forced_continuation() == '{"name":"'
    assert grammar.jump_forward(encode(tokenizer, '{"name":"'))
    assert grammar.forced_continuation() is None  # the name is free text
    assert grammar.accept_tokens(encode(tokenizer, 'fox"'))
    assert grammar.forced_continuation() == ',"age":'
    # retokenize the last token together with the forced text, as the scheduler does
    tail = encode(tokenizer, '"' + ',"age":')
    assert grammar.jump_forward(tail, rollback=1)
    assert grammar.accept_tokens(encode(tokenizer, "42}"))
    assert grammar.is_finished() and grammar.forced_continuation() is None
    assert grammar.accept_token(EOS)


def test_whitespace_makes_the_first_key_a_choice(backend):
    """One optional space between JSON tokens by default (outlines' default; json.dumps's
    spacing is allowed, so is compact JSON)."""
    assert GrammarSpec.json_schema(PERSON) == GrammarSpec.json_schema(PERSON, whitespace=r"[ ]?")
    spec = GrammarSpec.json_schema(PERSON)
    assert backend.matcher(backend.compile(spec)).forced_continuation() == "{"


def test_failed_jump_forward_leaves_the_state_unchanged(backend, tokenizer):
    grammar = backend.matcher(backend.compile(GrammarSpec.json_schema(PERSON, whitespace="")))
    assert grammar.accept_tokens(encode(tokenizer, '{"name":"ab'))
    before = mask(grammar, len(tokenizer))
    assert not grammar.jump_forward(encode(tokenizer, '"x'), rollback=2)
    assert torch.equal(mask(grammar, len(tokenizer)), before)
    assert grammar.accept_tokens(encode(tokenizer, '","age":1}'))


def test_rollback_then_reaccept_restores_the_state(backend, tokenizer):
    grammar = backend.matcher(backend.compile(GrammarSpec.json_schema(PERSON)))
    first, rest = encode(tokenizer, '{"name":'), encode(tokenizer, '"cat","age":12')
    assert grammar.accept_tokens(first)
    at_first = (mask(grammar, len(tokenizer)), grammar.forced_continuation())
    assert grammar.accept_tokens(rest)
    at_rest = mask(grammar, len(tokenizer))
    assert grammar.rollback(len(rest)) == rest
    assert torch.equal(mask(grammar, len(tokenizer)), at_first[0])
    assert grammar.forced_continuation() == at_first[1]
    assert grammar.accept_tokens(rest)
    assert torch.equal(mask(grammar, len(tokenizer)), at_rest)
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(first) + len(rest) + 1)


def test_disallowed_tokens_are_refused_atomically(backend, tokenizer):
    grammar = backend.matcher(backend.compile(GrammarSpec.regex(r"[0-9]{2,3}")))
    assert not grammar.accept_token(encode(tokenizer, "a")[0])
    assert not grammar.accept_token(EOS)  # not final yet
    assert not grammar.accept_tokens(encode(tokenizer, "1") * 4)
    assert grammar.accept_tokens(encode(tokenizer, "1") * 3)
    assert grammar.is_finished() and not grammar.can_continue()
    assert grammar.accept_token(EOS) and not grammar.accept_token(encode(tokenizer, "1")[0])
    assert not mask(grammar, len(tokenizer)).any()  # after a stop token nothing is allowed


def test_a_final_state_may_continue(backend, tokenizer):
    """outlines-core alone drops one-byte tokens out of a final state ("." after "1")."""
    grammar = backend.matcher(backend.compile(GrammarSpec.regex(r"[0-9]+(\.[0-9]+)?")))
    assert grammar.accept_tokens(encode(tokenizer, "1"))
    allowed = mask(grammar, len(tokenizer))
    assert allowed[encode(tokenizer, ".")[0]] and allowed[EOS]
    assert grammar.is_terminated() and not grammar.is_finished()
    optional = backend.matcher(backend.compile(GrammarSpec.regex("(ab)?")))
    assert mask(optional, len(tokenizer))[encode(tokenizer, "a")[0]]


def test_custom_stop_tokens_only_in_final_states(backend, tokenizer):
    compiled = backend.compile(GrammarSpec.regex("(yes|no)"))
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    grammar = backend.matcher(compiled, stop_token_ids=[end])
    assert not mask(grammar, len(tokenizer))[[end, EOS]].any()
    assert grammar.accept_tokens(encode(tokenizer, "no"))
    allowed = mask(grammar, len(tokenizer))
    assert allowed[end] and not allowed[EOS]  # EOS is not a stop token of this request
    assert allowed.sum() == 1 and grammar.is_finished()


def test_row_shorter_than_outlines_wants():
    """A vocabulary without specials but EOS: outlines wants one more bit than the row."""
    tokens = (*(bytes([ord("a") + i % 26]) * (1 + i // 26) for i in range(63)), None)
    backend = OutlinesBackend(TokenVocabulary(tokens, 63))
    grammar = backend.matcher(backend.compile(GrammarSpec.regex("(a|bb)+")))
    allowed = mask(grammar, 64)
    assert allowed.nonzero().flatten().tolist() == [0, 1, 26, 27, 52, 53]  # a b aa bb aaa bbb
    with pytest.raises(ValueError, match="words"):
        grammar.fill_bitmask(torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("backend_class", [OutlinesBackend, GuidanceBackend])
@pytest.mark.parametrize("extra", [-300, 40])
def test_logits_narrower_or_wider_than_the_tokenizer(backend_class, tokenizer, extra):
    width = len(tokenizer) + extra
    backend = backend_class.from_tokenizer(tokenizer, logits_width=width)
    grammar = backend.matcher(backend.compile(GrammarSpec.regex("[a-z]{1,3}")))
    allowed = mask(grammar, width)
    letters = [i for i in range(min(width, len(tokenizer))) if 0 < len(t := tokenizer.decode([i])) <= 3
               and t.isascii() and t.isalpha() and t.islower()]
    assert allowed.nonzero().flatten().tolist() == letters
    assert not grammar.accept_token(width) and not grammar.accept_token(len(tokenizer) + 10)


def test_matcher_refuses_a_grammar_of_another_tokenizer(backend, tmp_path):
    other = type(backend).from_tokenizer(build_tokenizer(tmp_path, vocab_size=400))
    with pytest.raises(ValueError, match="different tokenizer"):
        backend.matcher(other.compile(GrammarSpec.regex("a")))


@pytest.mark.parametrize(
    "spec, message",
    [
        (GrammarSpec.regex("(ab"), "missing \\)"),
        (GrammarSpec.regex("ab)"), "unbalanced parenthesis"),
        (GrammarSpec.regex("a(?=b)"), "lookahead"),
        (GrammarSpec.regex("(?<!a)b"), "lookbehind"),
        (GrammarSpec.regex(r"(a)\1"), "backreference"),
        (GrammarSpec.regex(r"\bcat"), "word boundary"),
        (GrammarSpec.regex("^cat$"), "anchor"),
        (GrammarSpec.regex("[a-"), "unterminated character class"),
        (GrammarSpec.regex("a{3,1}"), "cannot compile regex"),
        (GrammarSpec.json_schema("[1, 2]"), "must be a JSON object"),
        (GrammarSpec.json_schema('{"type": "foo"}'), "Unsupported type: foo"),
        (GrammarSpec.json_schema("{not json"), "not valid JSON"),
        (GrammarSpec.json_schema('{"type": "string", "minLength": "x"}'), "non-negative integer"),
        (GrammarSpec.json_schema('{"type": "array", "maxItems": -1}'), "non-negative integer"),
        (GrammarSpec("choices", "[]"), "non-empty list"),
    ],
)
def test_invalid_specs_raise_a_named_value_error(backend, spec, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(spec)


def test_spec_validation():
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("lark", "x")
    with pytest.raises(ValueError, match="whitespace"):
        GrammarSpec("regex", "a", whitespace=" ")
    assert json.loads(GrammarSpec.choices(["a", "b"]).text) == ["a", "b"]
    assert GrammarSpec.json_schema({"a": 1}) == GrammarSpec.json_schema('{"a": 1}')
    assert spec_from_params(SamplingParams(regex="[0-9]+")) == GrammarSpec.regex("[0-9]+")
    schema = {"type": "integer"}
    assert spec_from_params(SamplingParams(json_schema=schema)) == GrammarSpec.json_schema(schema)
    assert spec_from_params(SamplingParams()) is None


def test_every_scheduler_grammar_backend_exists():
    from sprig.runtime.constrained import REGULAR_BACKENDS
    from sprig.runtime.scheduler.config import GRAMMAR_BACKENDS

    assert set(GRAMMAR_BACKENDS) == set(REGULAR_BACKENDS)


@pytest.mark.parametrize("backend_class", [OutlinesBackend, GuidanceBackend])
def test_an_added_token_is_its_text(backend_class, tmp_path):
    """A chat model's markers are added tokens (`</tool_call>` in Qwen's vocabulary, not
    special): a grammar that spells the marker allows the model's own token for it, in
    llguidance too (whose own reading of tokenizer.json makes every added token special)."""
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    close = tok.convert_tokens_to_ids("</tool_call>")
    backend = backend_class.from_tokenizer(tok)
    grammar = backend.matcher(backend.compile(GrammarSpec.regex("a\n</tool_call>")))
    ids = encode(tok, "a\n</tool_call>")
    assert ids[-1] == close and grammar.accept_tokens(ids[:-1])
    assert mask(grammar, len(tok))[close] and grammar.accept_token(close) and grammar.is_terminated()


def test_a_regex_as_a_lark_grammar_matches_what_the_regex_matches(tokenizer):
    """`lark_grammar` hands a regex to llguidance as an `ebnf` spec: slashes, escaped
    slashes and newlines (raw or escaped) keep their meaning."""
    from sprig.runtime.constrained.regex_text import lark_grammar

    regex = "a/b\\/c(\n|\\\n)[/x]+"
    backend = GuidanceBackend.from_tokenizer(tokenizer)
    compiled = backend.prepare(backend.compile(GrammarSpec("ebnf", lark_grammar(regex))))
    for text in ("a/b/c\n/", "a/b/c\nx/x", "a/b/c\n", "a/bc\n/", "a/b/c/x", "a/b/c\n\n/"):
        grammar = backend.matcher(compiled, stop_token_ids={EOS})
        took = grammar.accept_tokens(encode(tokenizer, text)) and grammar.is_terminated()
        assert took == (re.fullmatch(regex, text) is not None), text


def test_a_token_too_long_for_llguidance_is_never_produced(tmp_path):
    """llguidance's token trie panics on a token of 1,497 bytes (a BPE trained on code had
    one): such a token is special to it, and the backend works."""
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_tokens(["#" * 1500])
    long = tok.convert_tokens_to_ids("#" * 1500)
    backend = GuidanceBackend.from_tokenizer(tok)
    grammar = backend.matcher(backend.compile(GrammarSpec.regex("#+")))
    allowed = mask(grammar, len(tok))
    assert allowed[encode(tok, "#")[0]] and not allowed[long] and not grammar.accept_token(long)


@pytest.mark.parametrize("backend_class", [OutlinesBackend, GuidanceBackend])
@pytest.mark.parametrize(("regex", "special"), [("a<s>b", 1), ("a</s>", EOS), ("a<\\|end\\|>", 3)])
def test_a_special_tokens_name_in_a_regex_is_text(backend_class, tokenizer, regex, special):
    """A regex that spells a special token's name (`<s>`; `</s>`, the EOS; `<|end|>`, a
    stop) matches that text, written by ordinary tokens: the special token itself, which
    a response's text leaves out, is never allowed. (llguidance read forced text with the
    special tokens split out, so it allowed `<s>` itself, and no token at all where the
    special token was a stop.)"""
    text = re.sub(r"\\(.)", r"\1", regex)
    assert tokenizer.convert_ids_to_tokens(special) in text
    backend = backend_class.from_tokenizer(tokenizer)
    grammar = backend.matcher(backend.compile(GrammarSpec.regex(regex)), stop_token_ids={EOS, 3})
    plain = [encode(tokenizer, ch)[0] for ch in text]  # one byte-level token per character
    assert grammar.accept_token(plain[0])
    allowed = mask(grammar, len(tokenizer))
    assert allowed[plain[1]] and not allowed[special] and not allowed[:4].any()
    assert not grammar.accept_token(special)
    assert grammar.accept_tokens(plain[1:]) and grammar.is_terminated()
