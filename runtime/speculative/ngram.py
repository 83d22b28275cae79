"""Prompt-lookup drafting: the request's own context predicts its continuation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramDrafter:
    """Proposes what followed the most recent earlier occurrence of the context's longest
    suffix of `min_ngram ..= max_ngram` tokens; its alternatives are what followed the
    earlier occurrences of that suffix, latest first, where they differ. Pure: a function
    of the context alone."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return next(iter(self._paths(context, k, 1)), [])

    def alternatives(self, context: Sequence[int], k: int, width: int) -> list[list[int]]:
        """At most `width` other continuations of the suffix `propose` matched, of at most
        `k` tokens each, from its earlier occurrences (latest first), each unlike the
        draft and every other."""
        return self._paths(context, k, width + 1)[1:]

    def _paths(self, context: Sequence[int], k: int, width: int) -> list[list[int]]:
        ctx = np.asarray(context, dtype=np.int64)
        size = ctx.shape[0]
        if k <= 0 or size <= self.min_ngram:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            out: list[list[int]] = []
            for start in occurrences(ctx, ctx[size - n :])[::-1]:
                path = ctx[start : start + k].tolist()
                if path not in out:
                    out.append(path)
                    if len(out) == width:
                        break
            if out:
                return out
        return []


def occurrences(seq: np.ndarray, suffix: np.ndarray) -> np.ndarray:
    """Where the tokens after each occurrence of `suffix` in `seq` that ends before `seq`
    does begin, ascending."""
    n = suffix.shape[0]
    hits = np.flatnonzero(seq[: max(seq.shape[0] - n, 0)] == suffix[0])  # starts i < len - n (none if n > len)
    for j in range(1, n):
        hits = hits[seq[hits + j] == suffix[j]]
    return hits + n


def follows(seq: np.ndarray, suffix: np.ndarray) -> int | None:
    """Where the tokens after the last occurrence of `suffix` in `seq` that ends before
    `seq` does begin, or None if there is none."""
    hits = occurrences(seq, suffix)
    return int(hits[-1]) if hits.size else None
