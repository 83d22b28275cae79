"""Range regexes (property-tested against exact arithmetic) and regex-text surgery."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.runtime.constrained.numeric_ranges import Bound, integer_range_regex, number_range_regex
from sprig.runtime.constrained.regex_text import (
    ascii_digits,
    check_supported,
    escape_literal,
    json_string_pattern,
)

ends = st.none() | st.integers(-(10**7), 10**7)
small_ends = st.none() | st.integers(-60, 60)
bounds = st.none() | st.builds(Bound, st.integers(-40, 40), st.booleans())


def _in(x: Fraction | int, lo: Bound | None, hi: Bound | None) -> bool:
    above = lo is None or (x > lo.value if lo.exclusive else x >= lo.value)
    below = hi is None or (x < hi.value if hi.exclusive else x <= hi.value)
    return above and below


@settings(max_examples=200, deadline=None)
@given(lo=ends, hi=ends, xs=st.lists(st.integers(-(2 * 10**7), 2 * 10**7), max_size=20))
def test_integer_range_matches_exactly_the_range(lo, hi, xs):
    if lo is not None and hi is not None and lo > hi:
        with pytest.raises(ValueError, match="no integer"):
            integer_range_regex(lo, hi)
        return
    rx = re.compile(integer_range_regex(lo, hi))
    probes = set(xs) | {0, 1, -1} | {e + d for e in (lo, hi) if e is not None for d in (-1, 0, 1)}
    for x in probes:
        assert bool(rx.fullmatch(str(x))) == (
            (lo is None or x >= lo) and (hi is None or x <= hi)
        ), x


@settings(max_examples=200, deadline=None)
@given(lo=small_ends, hi=small_ends, text=st.from_regex(r"-?[0-9]{1,3}", fullmatch=True))
def test_integer_range_matches_only_canonical_decimals(lo, hi, text):
    if lo is not None and hi is not None and lo > hi:
        return
    if re.fullmatch(integer_range_regex(lo, hi), text):
        assert text == str(int(text))  # no leading zeros, no "-0"
        assert (lo is None or int(text) >= lo) and (hi is None or int(text) <= hi)


number_texts = st.builds(
    lambda sign, whole, frac: f"{sign}{whole}{frac}",
    st.sampled_from(["", "-"]),
    st.integers(0, 45),
    st.sampled_from(["", ".0", ".00", ".5", ".05", ".999", ".10", ".001"]),
)


@settings(max_examples=250, deadline=None)
@given(lo=bounds, hi=bounds, texts=st.lists(number_texts, min_size=1, max_size=25))
def test_number_range_matches_exactly_the_range(lo, hi, texts):
    try:
        rx = re.compile(number_range_regex(lo, hi))
    except ValueError:  # only when no number fits
        assert lo is not None and hi is not None
        assert lo.value > hi.value or (lo.value == hi.value and (lo.exclusive or hi.exclusive))
        return
    for text in texts:
        assert bool(rx.fullmatch(text)) == _in(Fraction(text), lo, hi), text


def test_number_range_refuses_exponents_and_leading_zeros():
    rx = re.compile(number_range_regex(Bound(0), Bound(100)))
    for text in ["1e2", "01", "1.", ".5", "+1", "00.5"]:
        assert not rx.fullmatch(text), text


@pytest.mark.parametrize(
    "regex, feature",
    [
        ("a(?=b)", "lookahead"),
        ("a(?!b)", "negative lookahead"),
        ("(?<=a)b", "lookbehind"),
        ("(?<!a)b", "negative lookbehind"),
        (r"(a)\1", "backreference"),
        (r"(?P<x>a)\k<x>", "named backreference"),
        (r"\bword", "word boundary"),
        ("^abc", "anchor ^"),
        ("abc$", "anchor $"),
        (r"\Aabc", "anchor"),
    ],
)
def test_unsupported_features_are_named(regex, feature):
    with pytest.raises(ValueError, match=re.escape(feature)):
        check_supported(regex)


def test_supported_lookalikes_pass():
    for regex in [r"[\^$]a", r"a\$", r"(?:x)", r"(?P<n>a)", r"(?i)ab", r"[(?=]"]:
        check_supported(regex)


def test_ascii_digits_rewrites_only_real_digit_classes():
    assert ascii_digits(r"\d+") == "[0-9]+"
    assert ascii_digits(r"[\d.]") == "[0-9.]"
    assert ascii_digits(r"\\d") == r"\\d"  # an escaped backslash then a literal d
    assert ascii_digits(r"[\\d]") == r"[\\d]"
    assert not re.fullmatch(ascii_digits(r"\d"), "٣")  # Arabic-Indic three


def test_escape_literal_round_trips():
    text = "a.b*(c)[d]{e}|f^g$h\\i+j?k#l&m-n~o é\n"
    assert re.fullmatch(escape_literal(text), text)
    assert not re.fullmatch(escape_literal(text), text.replace(".", "x"))


def test_json_string_pattern_excludes_what_json_escapes():
    rx = re.compile(json_string_pattern(r"^a.b[^x]\S\D\W$"))
    assert rx.fullmatch("a-by!!!")
    for bad in ['a"by!!!', "a\\by!!!", "a\nby!!!", 'a-b"!!!', "a-by\x01!!"]:
        assert not rx.fullmatch(bad), bad
    assert json_string_pattern("[^]a]") == '[^"\\\\\\x00-\\x1F\\]a]'
