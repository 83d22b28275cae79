"""Incremental detokenization and stop strings, against the tokenizer's own `decode`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sprig.runtime.detokenizer import (
    DecodeDelta,
    DetokenizeConfig,
    IncrementalDecoder,
    RequestDetokenizer,
    StopMatcher,
    decode_tokens_for_logprobs,
)
from sprig.runtime.tiny_checkpoint import build_tokenizer

T = TypeVar("T")
FFFD = "\ufffd"
PROPERTY = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
UNITS = ["é", "中文", "😀", "ü", " é", "hello", " world", ".", " the", "Paris", "?", "\n", " 中"]


@pytest.fixture(scope="module")
def bbpe(tmp_path_factory: pytest.TempPathFactory):
    """The tiny byte-level BPE tokenizer of the test checkpoints, loaded as users load it."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("bbpe")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(Path(path))


def _sentencepiece_like(style: str):
    """A Llama-style tokenizer: Metaspace pre-tokenizer, BPE with `<0xNN>` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdehlorw!.,?", "▁hello", "▁world", "hello", "world", "▁é", "é"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = {
        "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()]),
        "llama": decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        ),
    }[style]
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def sp(request: pytest.FixtureRequest):
    return _sentencepiece_like(request.param)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _chunks(seq: Sequence[T], cuts: list[int]) -> list[Sequence[T]]:
    """`seq` cut at the given offsets (taken modulo its length + 1)."""
    bounds = sorted({0, len(seq), *(c % (len(seq) + 1) for c in cuts)})
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


def _stream(dec: IncrementalDecoder, chunks: list[list[int]]) -> list[str]:
    return [dec.push(c) for c in chunks] + [dec.flush()]


def _unit_ids(tok, units: list[str]) -> list[int]:
    """Ids of whole units, each tokenized alone: multi-byte characters become byte pieces."""
    return [i for u in units for i in _ids(tok, u)]


cuts_st = st.lists(st.integers(0, 200), max_size=12)


@PROPERTY
@given(ids=st.lists(st.integers(0, 511), max_size=40), cuts=cuts_st, skip=st.booleans())
def test_bbpe_concat_equals_decode_any_ids(bbpe, ids, cuts, skip):
    dec = IncrementalDecoder(bbpe, skip_special_tokens=skip)
    assert "".join(_stream(dec, _chunks(ids, cuts))) == bbpe.decode(ids, skip_special_tokens=skip)


@PROPERTY
@given(
    units=st.lists(st.sampled_from(UNITS), max_size=12), cuts=cuts_st, prompt=st.sampled_from(UNITS)
)
def test_bbpe_split_characters_never_leak(bbpe, units, cuts, prompt):
    ids = _unit_ids(bbpe, units)
    assert any(len(_ids(bbpe, u)) > 1 for u in ("é", "中文", "😀"))  # they really split
    deltas = _stream(IncrementalDecoder(bbpe, _ids(bbpe, prompt)), _chunks(ids, cuts))
    assert "".join(deltas) == "".join(units) == bbpe.decode(ids)
    assert not any(FFFD in d for d in deltas)


def _sp_ids(sp, unit: str) -> list[int]:
    """A vocabulary piece, or a character spelled as its `<0xNN>` byte pieces."""
    if unit in sp.vocab:
        return [sp.convert_tokens_to_ids(unit)]
    return sp.convert_tokens_to_ids([f"<0x{b:02X}>" for b in unit.encode()])


@PROPERTY
@given(
    units=st.lists(
        st.sampled_from(["▁hello", "▁world", "hello", "▁", "!", "é", "中", "😀", "</s>"]),
        max_size=12,
    ),
    prompt=st.lists(st.sampled_from(["<s>", "▁hello", "world", "é"]), max_size=7),
    cuts=cuts_st,
    skip=st.booleans(),
)
def test_sentencepiece_concat_equals_decode(sp, units, prompt, cuts, skip):
    ids = [i for u in units for i in _sp_ids(sp, u)]
    ctx = [i for u in prompt for i in _sp_ids(sp, u)]
    deltas = _stream(IncrementalDecoder(sp, ctx, skip_special_tokens=skip), _chunks(ids, cuts))
    ctx = ctx[-5:]
    expected = sp.decode(ctx + ids, skip_special_tokens=skip)[
        len(sp.decode(ctx, skip_special_tokens=skip)) :
    ]
    assert "".join(deltas) == expected
    assert not any(FFFD in d for d in deltas)
    if not ctx:
        assert expected == sp.decode(ids, skip_special_tokens=skip)


def test_first_output_token_joins_prompt_spacing(sp, bbpe):
    hello, world = sp.convert_tokens_to_ids(["▁hello", "▁world"])
    assert IncrementalDecoder(sp, [hello]).push([world]) == " world"
    assert IncrementalDecoder(sp, []).push([world]) == "world" == sp.decode([world])
    assert IncrementalDecoder(bbpe, _ids(bbpe, "hello")).push(_ids(bbpe, " world")) == " world"


def test_prompt_ending_mid_character_is_not_context(bbpe):
    c3, a9 = _ids(bbpe, "é")
    dec = IncrementalDecoder(bbpe, [*_ids(bbpe, "the"), c3])
    assert dec.push([a9]) + dec.push(_ids(bbpe, "x")) + dec.flush() == bbpe.decode(
        [a9, *_ids(bbpe, "x")]
    )


def test_held_character_flushed_at_finish(bbpe):
    dec = IncrementalDecoder(bbpe)
    assert dec.push(_ids(bbpe, "ab")) == "ab"
    assert dec.push(_ids(bbpe, "中")[:2]) == ""
    assert dec.flush() == FFFD == bbpe.decode(_ids(bbpe, "中")[:2])
    assert dec.flush() == ""


class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, tok) -> None:
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_redecode_window_is_bounded(bbpe):
    ids = _unit_ids(bbpe, UNITS) * 40
    counting = _CountingTokenizer(bbpe)
    dec = IncrementalDecoder(counting, _ids(bbpe, "a long prompt " * 50))
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == bbpe.decode(ids)
    assert max(counting.lengths) <= 8 and len(counting.lengths) <= 3 * len(ids)


def _run(tok, ids: list[int], chunks: list[int] | None = None, **cfg) -> list[DecodeDelta]:
    """Push `ids` in chunks of the given sizes (default one id each), then finish."""
    det = RequestDetokenizer(tok, [], DetokenizeConfig(**cfg))
    sizes, out, pos = chunks or [1] * len(ids), [], 0
    for n in sizes:
        out.append(det.step(ids[pos : pos + n]))
        pos += n
    out.append(det.step(ids[pos:], finished=True))
    return out


TEXT = "the quick brown fox jumps over the lazy dog"


def test_stop_string_spanning_tokens_is_trimmed_and_never_shown(bbpe):
    ids = _ids(bbpe, TEXT)
    spanned = [
        t for t in bbpe.convert_ids_to_tokens(ids) if set(t.replace("Ġ", " ")) & set("ick bro")
    ]
    assert len(spanned) >= 2
    deltas = _run(bbpe, ids, stop=("ick bro",))
    assert "".join(d.text_delta for d in deltas) == "the qu"
    assert [d.stop_matched for d in deltas if d.stop_matched] == ["ick bro"]
    first = next(k for k, d in enumerate(deltas) if d.finished)
    assert deltas[first].stop_matched == "ick bro" and first < len(deltas) - 1
    assert all(d == DecodeDelta("", None, True) for d in deltas[first + 1 :])


def test_no_stop_trim_keeps_stop_but_nothing_after(bbpe):
    deltas = _run(bbpe, _ids(bbpe, TEXT), stop=("ick bro",), no_stop_trim=True)
    assert "".join(d.text_delta for d in deltas) == "the quick bro"


def test_earliest_completed_stop_wins(bbpe):
    ids = _ids(bbpe, TEXT)
    assert (
        "".join(d.text_delta for d in _run(bbpe, ids, stop=("lazy", "fox"))) == "the quick brown "
    )
    first_done = _run(bbpe, ids, stop=("the quick brown fox", "brown"))  # not the first to start
    assert [d.stop_matched for d in first_done if d.stop_matched] == ["brown"]
    tie = _run(bbpe, ids, stop=("fox", "brown fox"))  # both end together: the longer wins
    assert "".join(d.text_delta for d in tie) == "the quick "
    assert [d.stop_matched for d in tie if d.stop_matched] == ["brown fox"]


def test_partial_stop_is_held_then_released(bbpe):
    ids = _ids(bbpe, "the lazy the")
    deltas = _run(bbpe, ids, stop=("the end",))
    visible = "".join(d.text_delta for d in deltas)
    assert visible == "the lazy the" and not any(d.stop_matched for d in deltas)
    shown = [d.text_delta for d in deltas]
    assert next(d for d in shown if d).startswith("the l")  # "the" waits until "l" rules it out
    assert shown[-1] == "the"  # the trailing "the" is only released at finish


@pytest.mark.parametrize(
    ("skip", "expected"), [(True, "hello world"), (False, "hello<|end|> world</s>")]
)
def test_skip_special_tokens(bbpe, skip, expected):
    ids = [*_ids(bbpe, "hello"), bbpe.convert_tokens_to_ids("<|end|>"), *_ids(bbpe, " world"), 2]
    assert "".join(d.text_delta for d in _run(bbpe, ids, skip_special_tokens=skip)) == expected
    stopped = _run(bbpe, ids, skip_special_tokens=skip, stop=("<|end|>",))
    assert "".join(d.text_delta for d in stopped) == ("hello world" if skip else "hello")


def test_stop_next_to_split_multibyte_characters(bbpe):
    ids = _ids(bbpe, "a é!中文 b")
    assert len(ids) > 8
    deltas = _run(bbpe, ids, stop=("é!",))
    assert "".join(d.text_delta for d in deltas) == "a " and not any(
        FFFD in d.text_delta for d in deltas
    )
    kept = _run(bbpe, ids, stop=("中",), no_stop_trim=True)
    assert "".join(d.text_delta for d in kept) == "a é!中"
    released = _run(bbpe, ids, stop=("éx", "中x"))
    assert [d.text_delta for d in released if d.text_delta] == ["a", " ", "é!", "中文", " b"]


def _reference_stop(text: str, stop: tuple[str, ...], no_trim: bool) -> tuple[str, str | None]:
    """The first end offset at which some stop string is complete; longest on ties."""
    for end in range(1, len(text) + 1):
        done = sorted((s for s in stop if text[:end].endswith(s)), key=len)
        if done:
            return text[: end if no_trim else end - len(done[-1])], done[-1]
    return text, None


@PROPERTY
@given(
    text=st.text("ab é", max_size=30),
    stop=st.lists(st.text("ab é", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=cuts_st,
    no_trim=st.booleans(),
)
def test_stop_matcher_streaming_equals_reference(text, stop, cuts, no_trim):
    matcher = StopMatcher(tuple(stop), no_trim)
    pieces = [matcher.push(c) for c in _chunks(text, cuts)] + [matcher.push("", True)]
    visible = "".join(p[0] for p in pieces)
    matched = [p[1] for p in pieces if p[1] is not None]
    assert (visible, matched[0] if matched else None) == _reference_stop(text, tuple(stop), no_trim)
    assert len(matched) <= 1 and matcher.push("ab") == ("", None)  # done after final


@PROPERTY
@given(units=st.lists(st.sampled_from(UNITS), max_size=10), cuts=cuts_st, data=st.data())
def test_request_streaming_equals_non_streaming(bbpe, units, cuts, data):
    ids, text = _unit_ids(bbpe, units), "".join(units)
    stop = data.draw(
        st.lists(st.sampled_from([*UNITS, " wor", "ld.", "中文 "]), min_size=1, max_size=2)
    )
    chunks = _chunks(ids, cuts)
    det = RequestDetokenizer(bbpe, [], DetokenizeConfig(stop=tuple(stop)))
    deltas = [det.step(c) for c in chunks] + [det.step([], finished=True)]
    assert "".join(d.text_delta for d in deltas) == _reference_stop(text, tuple(stop), False)[0]
    assert all(FFFD not in d.text_delta for d in deltas) and det.finished


def test_logprob_token_texts(bbpe):
    ids = [*_ids(bbpe, "hello world"), bbpe.convert_tokens_to_ids("<|end|>"), *_ids(bbpe, "é")]
    assert decode_tokens_for_logprobs(bbpe, ids) == ["h", "ello", " world", "<|end|>", FFFD, FFFD]
    assert decode_tokens_for_logprobs(bbpe, []) == []


@pytest.mark.parametrize("stop", [("",), ["x"], ("x", 3)])
def test_config_rejects_bad_stops(stop):
    with pytest.raises(ValueError, match="stop"):
        DetokenizeConfig(stop=stop)
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(stop)
