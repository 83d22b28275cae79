"""Rows of a batch padded to shared shapes, so that one torch call attends many of them.

`PaddedRows`: requests of similar context length, each row's slots padded to the
longest (decode remainders). `PaddedGroups`: groups of requests that share a prefix,
padded to the largest group and the longest prefix. Both are built once per step, from
that step's metadata alone, and hold no state across steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sprig.kernels.attention_lse import attention_lse
from sprig.kernels.paged import gather_kv
from sprig.radix.kv_cache import LayerKV


@dataclass(frozen=True)
class PaddedRows:
    """Requests of similar context length, their slots padded to the longest.

    Invariant: row i's context is `slots[i, :lens[i]]`; padding repeats a slot of the
    batch and is masked by `valid` (None when nothing is padding).
    """

    rows: torch.Tensor  # [b] int64: batch rows
    slots: torch.Tensor  # [b, L] int64
    valid: torch.Tensor | None  # [b, L] bool
    lens: torch.Tensor  # [b] int64


def pad_by_length(starts: torch.Tensor, lens: torch.Tensor, indices: torch.Tensor) -> list[PaddedRows]:
    """Bucket rows with slots (row b's: `indices[starts[b] : starts[b] + lens[b]]`) by
    length, so that padding at most doubles a bucket's work (longest first; a bucket's
    shortest is over half its longest; rows in order within a bucket)."""
    n = lens.tolist()
    order = sorted((i for i, length in enumerate(n) if length > 0), key=lambda i: -n[i])
    runs: list[list[int]] = []
    for i in order:
        if runs and 2 * n[i] > n[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    buckets = []
    for run in runs:
        longest, shortest = n[run[0]], n[run[-1]]
        run.sort()
        rows = torch.tensor(run, device=lens.device)  # [b]
        offs = torch.arange(longest, device=lens.device)  # [L]
        valid = offs[None, :] < lens[rows, None]  # [b, L]
        slots = indices[torch.where(valid, starts[rows, None] + offs[None, :], 0)]  # [b, L]
        buckets.append(PaddedRows(rows, slots, None if shortest == longest else valid, lens[rows]))
    return buckets


BucketKV = Callable[[int, PaddedRows], tuple[torch.Tensor, torch.Tensor]]
"""(bucket index, bucket) -> its K and V, [b, Hkv, L, D] each, any strides and dtype."""


def gather_layer(kv: LayerKV, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, Hkv, D] x2
    """K and V of the layer's rows `slots` (int64 `[n]`) as attention reads them: a
    quantized pool's dequantized (`gather_kv`)."""
    return gather_kv(kv.k, slots, kv.k_scale, kv.dtype), gather_kv(kv.v, slots, kv.v_scale, kv.dtype)


def attend_padded(
    q: torch.Tensor,  # [B, Hq, D]
    buckets: list[PaddedRows],
    bucket_kv: BucketKV,
    *,
    sm_scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, Hq, D] float32, [B, Hq] float32
    """Each bucket in one `attention_lse` call (scores capped by `softcap` when given), a
    KV head's query heads as its query rows (the K/V are read once for all of them). Every row's result is written at its own
    batch row, `bucket.rows`; rows in no bucket get zeros and -inf."""
    B, Hq, D = q.shape
    every_row = sum(bucket.rows.numel() for bucket in buckets) == B
    out = (torch.empty if every_row else torch.zeros)((B, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    for i, bucket in enumerate(buckets):
        k, v = bucket_kv(i, bucket)
        b, Hkv = k.shape[:2]
        valid = None if bucket.valid is None else bucket.valid[:, None, None, :]
        rows_q = q.index_select(0, bucket.rows).view(b, Hkv, Hq // Hkv, D)
        o, s = attention_lse(rows_q, k, v, scale=sm_scale, valid=valid, softcap=softcap)
        out.index_copy_(0, bucket.rows, o.reshape(b, Hq, D))
        lse.index_copy_(0, bucket.rows, s.reshape(b, Hq))
    return out, lse


def gather_bucket_kv(kv: LayerKV, bucket: PaddedRows) -> tuple[torch.Tensor, torch.Tensor]:  # [b, Hkv, L, D] x2
    """The bucket's K and V, gathered from the pool (views of fresh copies)."""
    b, L = bucket.slots.shape
    Hkv, D = kv.k.shape[1:]
    k, v = gather_layer(kv, bucket.slots.reshape(-1))
    return k.view(b, L, Hkv, D).transpose(1, 2), v.view(b, L, Hkv, D).transpose(1, 2)


@dataclass(frozen=True)
class QueryHeads:
    """A bucket of groups' query heads in `[g, Hkv, n, G]` order (group, KV head, row,
    the KV head's query heads): `tokens` and `heads` index a `[T, Hq, D]` query, `flat`
    the same pairs of its `[T * Hq]` flattening. `keep` lists the positions of the pairs
    of real rows (None when no row is padding): a padded row's pairs repeat its group's
    first."""

    tokens: torch.Tensor  # [g, Hkv, n, G] int64
    heads: torch.Tensor  # [g, Hkv, n, G] int64
    flat: torch.Tensor  # [m] int64: flat pairs of the real rows, in order
    keep: torch.Tensor | None  # [m] int64: positions of those pairs in [g, Hkv, n, G] order


@dataclass(frozen=True)
class PaddedGroups:
    """Groups of similar size, padded to one shape: group i's query rows `rows[i]` all
    attend to its shared slots `slots[i]`; `heads` places their query heads.

    Invariant: padding repeats a group's first row or slot; `slot_valid` masks padded
    slots and `real` padded rows (each None when there are none).
    """

    rows: torch.Tensor  # [g, n] int64
    slots: torch.Tensor  # [g, L] int64
    slot_valid: torch.Tensor | None  # [g, L] bool
    real: torch.Tensor | None  # [g, n] bool
    heads: QueryHeads


def pad_groups(
    rows: list[torch.Tensor], slots: list[torch.Tensor], q_heads: int, kv_heads: int
) -> list[PaddedGroups]:
    """Bucket groups by the binary magnitude of their row and slot counts (padding at most
    doubles either) and pad each bucket to its largest group."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, (r, s) in enumerate(zip(rows, slots, strict=True)):
        buckets.setdefault((r.numel().bit_length(), s.numel().bit_length()), []).append(i)
    padded = []
    for chosen in buckets.values():
        n = max(rows[i].numel() for i in chosen)
        L = max(slots[i].numel() for i in chosen)
        r = torch.stack([_pad_to(rows[i], n) for i in chosen])  # [g, n]
        s = torch.stack([_pad_to(slots[i], L) for i in chosen])  # [g, L]
        row_lens = torch.tensor([rows[i].numel() for i in chosen], device=r.device)
        slot_lens = torch.tensor([slots[i].numel() for i in chosen], device=s.device)
        real = torch.arange(n, device=r.device)[None, :] < row_lens[:, None]  # [g, n]
        slot_valid = torch.arange(L, device=s.device)[None, :] < slot_lens[:, None]  # [g, L]
        real_or_none = None if bool(real.all()) else real
        padded.append(PaddedGroups(
            r, s, None if bool(slot_valid.all()) else slot_valid, real_or_none,
            _query_heads(r, real_or_none, q_heads, kv_heads),
        ))
    return padded


def _query_heads(rows: torch.Tensor, real: torch.Tensor | None, q_heads: int, kv_heads: int) -> QueryHeads:
    g, n = rows.shape
    G = q_heads // kv_heads
    tokens = rows[:, None, :, None].expand(g, kv_heads, n, G)
    heads = torch.arange(q_heads, device=rows.device).view(1, kv_heads, 1, G).expand(g, kv_heads, n, G)
    flat = (tokens * q_heads + heads).flatten()
    keep = None
    if real is not None:
        keep = torch.nonzero(real[:, None, :, None].expand(g, kv_heads, n, G).flatten()).flatten()
        flat = flat[keep]
    return QueryHeads(tokens, heads, flat, keep)


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x[:1].expand(n - x.numel())]) if x.numel() < n else x


def gather_prefix_kv(kv: LayerKV, bucket: PaddedGroups) -> tuple[torch.Tensor, torch.Tensor]:  # [g, Hkv, L, D] x2
    """The bucket's shared K and V, per group and KV head: float32, contiguous."""
    g, L = bucket.slots.shape
    Hkv, D = kv.k.shape[1:]
    k, v = gather_layer(kv, bucket.slots.flatten())
    return (
        k.float().view(g, L, Hkv, D).transpose(1, 2).contiguous(),
        v.float().view(g, L, Hkv, D).transpose(1, 2).contiguous(),
    )
