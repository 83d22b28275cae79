"""Offline vocabulary: every token id maps to the exact bytes it adds to the output."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sprig.runtime.constrained.vocabulary import (
    END_MARK,
    build_vocabulary,
    special_token_ids,
    tokenizer_family,
)
from sprig.runtime.tiny_checkpoint import build_tokenizer

TEXTS = [
    '{"name": "x", "age": 12, "tags": ["a", "b"]}',
    "the quick brown fox jumps over the lazy dog.\n\tParis?",
    "é ü 中文 🙂 <b> (a) [1, 2, 3]",
]


def test_byte_level_tokens_concatenate_to_the_text(tokenizer):
    vocab = build_vocabulary(tokenizer)
    assert tokenizer_family(tokenizer) == "byte_level"
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode()


def test_special_tokens_and_eos_have_no_bytes(tokenizer):
    vocab = build_vocabulary(tokenizer)
    assert len(vocab) == len(tokenizer)
    for special in tokenizer.all_special_ids:
        assert vocab.token_bytes[special] is None
    assert vocab.eos_token_id == tokenizer.eos_token_id
    mark = END_MARK.encode()
    for token_id, data in enumerate(vocab.token_bytes):
        if data is None:
            continue
        could_spell_mark = any(data.endswith(mark[:n]) for n in range(1, len(mark) + 1))
        assert (vocab.outlines.get(data) is None) == could_spell_mark  # e.g. the byte 0xF4
        assert could_spell_mark or token_id in vocab.outlines.get(data)
    assert vocab.outlines.get(mark) == [vocab.mark_id] and vocab.mark_id >= len(vocab)
    assert vocab.outlines.get_eos_token_id() == tokenizer.eos_token_id


def test_added_tokens_flagged_special_have_no_bytes(tmp_path):
    """Llama 3's `<|python_tag|>` and gpt-oss's harmony markers are added tokens flagged
    special that the special tokens map does not list: decoding drops them, so a grammar
    must never produce them as their names' text (nor a constraint trigger read them so)."""
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.add_tokens([AddedToken("<|python_tag|>", special=True, normalized=False)], special_tokens=True)
    tok.add_tokens([AddedToken("<tool_call>", normalized=False)])  # an added ordinary token: its text
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tag, call = tok.convert_tokens_to_ids("<|python_tag|>"), tok.convert_tokens_to_ids("<tool_call>")
    assert tag not in tok.all_special_ids and tok.decode([tag], skip_special_tokens=True) == ""
    assert tag in special_token_ids(tok) and call not in special_token_ids(tok)
    vocab = build_vocabulary(tok)
    assert vocab.token_bytes[tag] is None and vocab.token_bytes[call] == b"<tool_call>"


def test_logits_width_drops_ids_past_it(tokenizer):
    narrow = build_vocabulary(tokenizer, logits_width=300)
    assert len(narrow) == 300
    assert len(build_vocabulary(tokenizer, logits_width=4096)) == len(tokenizer)


def test_fingerprint_identifies_the_vocabulary(tokenizer, tmp_path):
    assert build_vocabulary(tokenizer).fingerprint == build_vocabulary(tokenizer).fingerprint
    other = build_tokenizer(tmp_path, vocab_size=400)
    assert build_vocabulary(other).fingerprint != build_vocabulary(tokenizer).fingerprint
    narrow = build_vocabulary(tokenizer, logits_width=300)
    assert narrow.fingerprint != build_vocabulary(tokenizer).fingerprint


def _sentencepiece_tokenizer(decoder) -> PreTrainedTokenizerFast:
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "▁": 3,
        "h": 4,
        "i": 5,
        "▁h": 6,
        "▁hi": 7,
        "<0x0A>": 8,
        "<0xC3>": 9,
        "<0xA9>": 10,
        "a": 11,
    }
    model = models.BPE(
        vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]),
        decoders.Metaspace(),
    ],
)
def test_sentencepiece_byte_fallback_and_spaces(decoder):
    tok = _sentencepiece_tokenizer(decoder)
    vocab = build_vocabulary(tok)
    assert tokenizer_family(tok) == "sentencepiece"
    ids = tok.encode("hi\né a", add_special_tokens=False)
    assert b"".join(vocab.token_bytes[i] for i in ids) == " hi\né a".encode()
    assert vocab.token_bytes[8] == b"\n" and vocab.token_bytes[9] == b"\xc3"
