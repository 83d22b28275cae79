"""Regexes for bounded JSON numbers, which outlines-core's schema compiler ignores.

`integer_range_regex(lo, hi)` matches exactly the canonical decimal integers (no leading
zeros, no "-0") in [lo, hi]; `number_range_regex` matches exactly the JSON numbers
without exponent, `-?(0|[1-9][0-9]*)(\\.[0-9]+)?`, whose value lies within integer bounds,
each inclusive or exclusive. None is an open end.
"""

from __future__ import annotations

from dataclasses import dataclass


def _span(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _any_digits(n: int) -> str:
    return {0: "", 1: "[0-9]"}.get(n, f"[0-9]{{{n}}}")


def _same_length(lo: str, hi: str) -> str:
    """Digit strings of one length between `lo` and `hi` (inclusive, lo <= hi)."""
    if not lo:
        return ""
    if lo[0] == hi[0]:
        return lo[0] + _same_length(lo[1:], hi[1:])
    rest = len(lo) - 1
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return _span(lo[0], hi[0]) + _any_digits(rest)
    parts = [lo[0] + _same_length(lo[1:], "9" * rest)]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(_span(str(int(lo[0]) + 1), str(int(hi[0]) - 1)) + _any_digits(rest))
    parts.append(hi[0] + _same_length("0" * rest, hi[1:]))
    return "(?:" + "|".join(parts) + ")"


def _natural(lo: int, hi: int | None) -> str | None:
    """Canonical decimals of the integers in [lo, hi], 0 <= lo; None if the range is empty."""
    if hi is not None and lo > hi:
        return None
    parts = []
    n = len(str(lo))
    while hi is None or n <= len(str(hi)):
        first = 10 ** (n - 1) if n > 1 else 0
        if hi is None and lo <= first and n > 1:
            parts.append(f"[1-9][0-9]{{{n - 1},}}")
            break
        top = hi if hi is not None and n == len(str(hi)) else 10**n - 1
        parts.append(_same_length(str(max(lo, first)), str(top)))
        n += 1
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _join(parts: list[str | None], what: str) -> str:
    kept = [p for p in parts if p is not None]
    if not kept:
        raise ValueError(f"no {what} satisfies the bounds")
    return kept[0] if len(kept) == 1 else "(?:" + "|".join(kept) + ")"


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """Canonical integers in [lo, hi]; `ValueError` if there are none."""
    positive = None if hi is not None and hi < 0 else _natural(max(lo or 0, 0), hi)
    negative = None
    if lo is None or lo < 0:
        magnitudes = _natural(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        negative = None if magnitudes is None else "-" + magnitudes
    return _join([negative, positive], "integer")


@dataclass(frozen=True)
class Bound:
    """An integer bound on a value; `exclusive` excludes the bound itself."""

    value: int
    exclusive: bool = False


def _magnitude(lo: Bound | None, hi: Bound | None) -> str | None:
    """`I(.F)?` with I + 0.F within the bounds (a magnitude is >= 0 by construction)."""
    if lo is None or lo.value < 0:
        lo = Bound(0)
    whole_lo = lo.value + lo.exclusive
    whole_hi = None if hi is None else hi.value - hi.exclusive
    frac_hi = None if hi is None else hi.value - 1  # I + f, f > 0, is <= hi iff I < hi
    whole = _natural(whole_lo, whole_hi)
    frac = _natural(lo.value, frac_hi)
    parts = [
        None if whole is None else whole + r"(?:\.0+)?",
        None if frac is None else frac + r"\.[0-9]*[1-9][0-9]*",
    ]
    kept = [p for p in parts if p is not None]
    return None if not kept else "(?:" + "|".join(kept) + ")"


def _negate(bound: Bound | None) -> Bound | None:
    return None if bound is None else Bound(-bound.value, bound.exclusive)


def number_range_regex(lo: Bound | None, hi: Bound | None) -> str:
    """Exponent-free JSON numbers within the bounds; `ValueError` if there are none."""
    negative = _magnitude(_negate(hi), _negate(lo))
    return _join([None if negative is None else "-" + negative, _magnitude(lo, hi)], "number")
