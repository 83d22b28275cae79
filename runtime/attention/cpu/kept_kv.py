"""K/V that the torch backend gathers for decode attention, kept across decode steps.

What is kept is what attention reads: float32 copies of the pool's K/V (a quantized
pool's dequantized as they are gathered, `gather_kv`), so a kept entry equals a fresh
gather whatever the pool stores.

Why it is valid: a decode step stores K/V only in slots just allocated for its new
tokens, so the slots a running request holds keep their contents from one decode step to
the next, and a slot can come to hold other K/V only through an extend step. Every entry
is checked against the step's own slots before it is reused (same slots, or the same
slots plus one new slot per row), and the owner calls `clear()` before every step that is
not a decode step. An entry's key is (layer, bucket index, *tag): the tag tells apart
plans over other views of the contexts (a sliding window's cut contexts are tagged with
the window). A cut context that slid by one slot (same length, its first slot dropped)
is not "the same slots plus one": its remainder is gathered again. The shadow mode
(`sprig.runtime.attention.shadow`) checks each use against the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.kernels.paged import gather_kv
from sprig.radix.kv_cache import LayerKV
from sprig.runtime.attention.cpu.buckets import (
    PaddedGroups,
    PaddedRows,
    gather_layer,
    gather_prefix_kv,
)

ROOM = 64  # decode steps a remainder buffer has room for, at least, when (re)allocated


class PrefixKV:
    """The decode groups' gathered prefix K/V (`gather_prefix_kv`), kept while their slots
    stay the same, up to `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        """Buckets whose K/V are kept."""
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def get(self, key: tuple[int, ...], bucket: PaddedGroups, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `bucket` (`key`: layer, bucket index, *tag), reused when its slots are
        unchanged."""
        hit = self._entries.get(key)
        if hit is not None and hit[0].shape == bucket.slots.shape and torch.equal(hit[0], bucket.slots):
            return hit[1], hit[2]
        if hit is not None:
            del self._entries[key]
            self._bytes -= hit[1].nbytes + hit[2].nbytes
        k, v = gather_prefix_kv(kv, bucket)
        if self._bytes + k.nbytes + v.nbytes <= self.budget_bytes:
            self._entries[key] = (bucket.slots, k, v)
            self._bytes += k.nbytes + v.nbytes
        return k, v


@dataclass
class _Tails:
    bucket: PaddedRows  # the bucket whose K/V the buffers hold
    k: torch.Tensor  # [b, Hkv, cap, D] float32, cap >= the bucket's L
    v: torch.Tensor  # [b, Hkv, cap, D] float32


class TailKV:
    """The decode buckets' remainder K/V (what `gather_bucket_kv` gathers, in float32;
    head-major, each row's keys one contiguous run), kept up to `budget_bytes`: when a
    step's bucket has the same rows as the kept one, each with the same slots plus one
    new slot (every request decoded one token), the kept K/V gain the new tokens' K/V
    instead of the whole bucket being gathered again.

    Rows keep their padded positions, so a row's new slot lands at its old length; the
    bucket's `valid` mask hides what lies beyond each row's length.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: dict[tuple[int, ...], _Tails] = {}
        self._bytes = 0
        # (bucket index, *tag) -> (kept bucket, step's bucket, each row's new slot or None), so
        # that every layer of a step reuses the first layer's verdict
        self._verdicts: dict[tuple[int, ...], tuple[PaddedRows, PaddedRows, torch.Tensor | None]] = {}

    def __len__(self) -> int:
        """Buckets whose K/V are kept."""
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._verdicts.clear()
        self._bytes = 0

    def get(self, key: tuple[int, ...], bucket: PaddedRows, kv: LayerKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `bucket` (`key`: layer, bucket index, *tag), `[b, Hkv, L, D]` float32
        each: the kept ones extended by a step, or gathered (and kept, within the budget)."""
        L = bucket.slots.shape[1]
        kept = self._entries.pop(key, None)
        if kept is not None:
            self._bytes -= kept.k.nbytes + kept.v.nbytes
            fresh = self._new_slots(key[1:], kept.bucket, bucket)
            kept = None if fresh is None else _extend(kept, bucket, fresh, kv)
        if kept is None:
            rows = _head_major_rows(bucket.slots, kv.k.shape[1])
            shape = bucket.slots.shape
            k = _gather(kv.k, kv.k_scale, kv.dtype, rows, shape)  # [b, Hkv, L, D]
            v = _gather(kv.v, kv.v_scale, kv.dtype, rows, shape)
            kept = _Tails(bucket, _with_room(k), _with_room(v))
        if self._bytes + kept.k.nbytes + kept.v.nbytes <= self.budget_bytes:
            self._entries[key] = kept
            self._bytes += kept.k.nbytes + kept.v.nbytes
        return kept.k[:, :, :L], kept.v[:, :, :L]

    def _new_slots(self, bucket_key: tuple[int, ...], old: PaddedRows, new: PaddedRows) -> torch.Tensor | None:
        """Each row's new slot `[b]` if `new` is `old` one decode step later (the same rows,
        each context the old one plus one slot), else None. `bucket_key`: the entry key
        without its layer, which the step's layers share."""
        seen = self._verdicts.get(bucket_key)
        if seen is not None and seen[0] is old and seen[1] is new:
            return seen[2]
        fresh = None
        if old.rows.shape == new.rows.shape and torch.equal(old.rows, new.rows) and torch.equal(new.lens, old.lens + 1):
            L = old.slots.shape[1]
            if old.valid is None:
                same = torch.equal(new.slots[:, :L], old.slots)
            else:
                same = torch.equal(new.slots[:, :L][old.valid], old.slots[old.valid])
            if same:
                fresh = new.slots[torch.arange(new.slots.shape[0]), old.lens]
        self._verdicts[bucket_key] = (old, new, fresh)
        return fresh


def _extend(kept: _Tails, new: PaddedRows, fresh: torch.Tensor, kv: LayerKV) -> _Tails:
    """Write each row's new token K/V (from its slot in `fresh`) at its old length, growing
    the buffers when they are full (`_with_room`). The room is zeros: a masked position's
    weight is 0, and 0 times uninitialised memory can be NaN."""
    k, v, at = kept.k, kept.v, kept.bucket.lens  # at: each row's new position
    if v.shape[2] < new.slots.shape[1]:
        k, v = _with_room(k), _with_room(v)
    rows = torch.arange(at.numel(), device=at.device)
    k_new, v_new = gather_layer(kv, fresh)
    k[rows, :, at] = k_new.float()
    v[rows, :, at] = v_new.float()
    return _Tails(new, k, v)


def _with_room(x: torch.Tensor) -> torch.Tensor:  # [b, Hkv, L, D] -> [b, Hkv, cap, D]
    """A contiguous copy of `x` whose positions (length L) gain room for
    `max(ROOM, L // 2)` decode steps, zeros: buffers are reallocated seldom (a
    reallocation costs about a step's reads of the buffer)."""
    b, h, L, d = x.shape
    out = x.new_zeros((b, h, L + max(ROOM, L // 2), d))
    out[:, :, :L] = x
    return out


def _head_major_rows(slots: torch.Tensor, kv_heads: int) -> torch.Tensor:  # [b*Hkv*L] int64
    """Rows of a pool buffer viewed `[S*Hkv, D]` that hold, in `[b, Hkv, L]` order, the
    K or V heads of `slots` `[b, L]`."""
    heads = torch.arange(kv_heads, device=slots.device)
    return (slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)


def _gather(
    buffer: torch.Tensor,  # [S, Hkv, D]
    scale: torch.Tensor | None,  # [S, Hkv]: a quantized pool's
    dtype: torch.dtype,
    rows: torch.Tensor,  # `_head_major_rows`
    shape: torch.Size,  # [b, L]
) -> torch.Tensor:  # [b, Hkv, L, D] float32
    """A float32 copy of a pool buffer's K or V heads at `_head_major_rows`, as attention
    reads them (`gather_kv`)."""
    S, Hkv, D = buffer.shape
    b, L = shape
    flat_scale = None if scale is None else scale.view(S * Hkv)
    return gather_kv(buffer.view(S * Hkv, D), rows, flat_scale, dtype).view(b, Hkv, L, D).float()


class KeptKV:
    """The torch backend's two stores, each within `budget_bytes`, cleared together."""

    def __init__(self, budget_bytes: int) -> None:
        self.prefixes = PrefixKV(budget_bytes)
        self.tails = TailKV(budget_bytes)

    def clear(self) -> None:
        self.prefixes.clear()
        self.tails.clear()
