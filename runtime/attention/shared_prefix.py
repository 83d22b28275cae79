"""Shared-prefix (cascade) attention, the torch backend's path for batches that share.

Requests that matched the same cached prefix hold the *same* KV slots for it: the radix
cache hands every match the slots of the one computed copy. Attention over such a group
reads the shared K/V once, as one matrix product for all the group's new tokens and query
heads (no mask: every new token comes after the prefix), then each request attends to the
rest of its own context, and the two partial results are merged by their log-sum-exp.
The result equals plain attention up to float rounding; the K/V traffic for a prefix
shared by n requests drops n-fold. Groups of similar size are padded to one shape and
attended together (`pad_groups`), so a step's cost in torch calls does not grow with its
number of groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sprig.kernels.attention_lse import attention_lse
from sprig.kernels.decode_attention import (
    PaddedRows,
    attend_padded,
    gather_bucket_kv,
    gather_rows,
    pad_by_length,
)
from sprig.kernels.extend_attention import request_attention_ref

if TYPE_CHECKING:
    from sprig.runtime.attention.kept_kv import KeptKV


@dataclass(frozen=True)
class SharedPrefix:
    """Batch rows `members` whose contexts all begin with the slots `slots`: two or more
    when planned; a decode step after requests left may keep fewer."""

    members: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [L] int64


@dataclass(frozen=True)
class SharingPlan:
    """A step's contexts split into shared prefixes and per-request remainders.

    Invariant: request b's context (`kv_indices[kv_indptr[b]:kv_indptr[b+1]]`) begins with
    its group's `slots`, `shared_lens[b]` of them (0 for a request in no group), and the
    rest, `rest_indices[rest_indptr[b]:rest_indptr[b+1]]`, is never empty for a grouped
    request.
    """

    groups: tuple[SharedPrefix, ...]
    kv_indptr: torch.Tensor  # [B+1] int64: the batch the plan describes
    kv_indices: torch.Tensor  # [N] int
    shared_lens: torch.Tensor  # [B] int64

    def after_decode(
        self,
        kv_indptr: torch.Tensor,  # [B+1] int
        kv_indices: torch.Tensor,  # [N] int
        new_slots: torch.Tensor,  # [B] int
        prev_rows: torch.Tensor,  # [B] int64, increasing
    ) -> SharingPlan | None:
        """The plan of the next decode step, whose batch (`kv_indptr`, `kv_indices`) the
        caller guarantees holds this plan's requests at rows `prev_rows`, in order, each
        context followed by one new slot, `new_slots[b]` (`ForwardBatch.prev_rows`); None
        if its lengths say otherwise. Keeps the groups (less the requests that left) and
        grows the decode buckets already built: O(B) work, where planning reads every
        slot of the batch."""
        indptr = kv_indptr.to(torch.int64)
        n_old, n_new = self.shared_lens.numel(), prev_rows.numel()
        if indptr.numel() != n_new + 1 or n_new > n_old or (n_new and int(prev_rows[-1]) >= n_old):
            return None
        old_lens = self.kv_indptr[1:] - self.kv_indptr[:-1]
        if not torch.equal(indptr[1:] - indptr[:-1], old_lens[prev_rows] + 1):
            return None
        built = vars(self)  # what the cached properties already hold
        new_slots = new_slots.to(torch.int64)
        if n_new == n_old:  # increasing rows: every request stayed, in its row
            plan = SharingPlan(self.groups, indptr, kv_indices, self.shared_lens)
            if "decode_groups" in built:  # groups and their slots are unchanged
                vars(plan)["decode_groups"] = built["decode_groups"]
            moved = None
        else:
            moved = torch.full((n_old,), -1, dtype=torch.int64, device=indptr.device)
            moved[prev_rows] = torch.arange(n_new, device=indptr.device)  # old row -> new row or -1
            groups = []
            for g in self.groups:
                members = moved[g.members]
                if bool((members >= 0).any()):
                    groups.append(SharedPrefix(members[members >= 0], g.slots))
            plan = SharingPlan(tuple(groups), indptr, kv_indices, self.shared_lens[prev_rows])
        if "rest_padded" in built:
            grown = (bucket.grown(new_slots, moved) for bucket in built["rest_padded"])
            vars(plan)["rest_padded"] = [bucket for bucket in grown if bucket is not None]
        return plan

    @cached_property
    def rest_indptr(self) -> torch.Tensor:  # [B+1] int64
        rest_lens = self.kv_indptr[1:] - self.kv_indptr[:-1] - self.shared_lens
        return F.pad(rest_lens.cumsum(0), (1, 0))

    @cached_property
    def rest_indices(self) -> torch.Tensor:  # [M] int64
        if not self.groups:
            return self.kv_indices.to(torch.int64)
        rest_indptr = self.rest_indptr
        rest_lens = rest_indptr[1:] - rest_indptr[:-1]
        starts = torch.repeat_interleave(self.kv_indptr[:-1] + self.shared_lens - rest_indptr[:-1], rest_lens)
        positions = torch.arange(int(rest_indptr[-1]), device=starts.device) + starts
        return self.kv_indices.to(torch.int64)[positions]

    @cached_property
    def rest_padded(self) -> list[PaddedRows]:
        """The remainders bucketed for decode (`pad_by_length`): built by the first
        decode layer of the step, reused by the others; extend steps never build them."""
        return pad_by_length(self.rest_indptr, self.rest_indices)

    @cached_property
    def decode_groups(self) -> list[PaddedGroups]:
        """The groups padded for decode, where a request's query row is its batch row;
        built by the first decode layer of the step, like `rest_padded`."""
        return pad_groups([g.members for g in self.groups], [g.slots for g in self.groups])


@dataclass(frozen=True)
class PaddedGroups:
    """Groups of similar size, padded to one shape: group i's query rows `rows[i]` all
    attend to its shared slots `slots[i]`.

    Invariant: padding repeats a group's first row or slot; `slot_valid` masks padded
    slots and `real` padded rows (each None when there are none).
    """

    rows: torch.Tensor  # [g, n] int64
    slots: torch.Tensor  # [g, L] int64
    slot_valid: torch.Tensor | None  # [g, L] bool
    real: torch.Tensor | None  # [g, n] bool
    _heads: dict[tuple[int, int], QueryHeads] = field(default_factory=dict, repr=False, compare=False)

    def query_heads(self, q_heads: int, kv_heads: int) -> QueryHeads:
        """Where the groups' query heads lie among a batch's `[T * q_heads]` (token, head)
        pairs, in the order the prefix attention reads them; made once per head counts."""
        key = (q_heads, kv_heads)
        if key not in self._heads:
            self._heads[key] = QueryHeads.of(self, q_heads, kv_heads)
        return self._heads[key]


@dataclass(frozen=True)
class QueryHeads:
    """A bucket's query heads in `[g, Hkv, n, G]` order (group, KV head, row, the KV
    head's query heads): `tokens` and `heads` index a `[T, Hq, D]` query, `flat` the same
    pairs of its `[T * Hq]` flattening. `keep` lists the positions of the pairs of real
    rows (None when no row is padding): a padded row's pairs repeat its group's first."""

    tokens: torch.Tensor  # [g, Hkv, n, G] int64
    heads: torch.Tensor  # [g, Hkv, n, G] int64
    flat: torch.Tensor  # [m] int64: flat pairs of the real rows, in order
    keep: torch.Tensor | None  # [m] int64: positions of those pairs in [g, Hkv, n, G] order

    @staticmethod
    def of(bucket: PaddedGroups, q_heads: int, kv_heads: int) -> QueryHeads:
        g, n = bucket.rows.shape
        G = q_heads // kv_heads
        tokens = bucket.rows[:, None, :, None].expand(g, kv_heads, n, G)
        heads = torch.arange(q_heads, device=tokens.device).view(1, kv_heads, 1, G).expand(g, kv_heads, n, G)
        flat = (tokens * q_heads + heads).flatten()
        keep = None
        if bucket.real is not None:
            keep = torch.nonzero(bucket.real[:, None, :, None].expand(g, kv_heads, n, G).flatten()).flatten()
            flat = flat[keep]
        return QueryHeads(tokens, heads, flat, keep)


def pad_groups(rows: list[torch.Tensor], slots: list[torch.Tensor]) -> list[PaddedGroups]:
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
        padded.append(PaddedGroups(
            r, s, None if bool(slot_valid.all()) else slot_valid, None if bool(real.all()) else real
        ))
    return padded


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x[:1].expand(n - x.numel())]) if x.numel() < n else x


def plan_shared_prefixes(
    kv_indptr: torch.Tensor,  # [B+1] int
    kv_indices: torch.Tensor,  # [N] int
    *,
    min_shared: int = 32,
) -> SharingPlan:
    """Group requests by the longest run of leading slots they all share (requests are
    grouped by their first slot, then the group's common run is measured); a group needs
    two or more requests sharing at least `min_shared` slots. Without groups every
    remainder is the whole context."""
    indptr = kv_indptr.to(torch.int64)
    indices = kv_indices.to(torch.int64)
    lens = indptr[1:] - indptr[:-1]  # [B]
    has_ctx = lens > 0
    skip = torch.zeros_like(lens)  # [B] shared tokens per request
    if int(has_ctx.sum()) < 2:
        return SharingPlan((), indptr, indices, skip)
    first = torch.where(has_ctx, indices[indptr[:-1].clamp(max=max(indices.numel() - 1, 0))], -1)  # [B]
    values, inverse, counts = torch.unique(first, return_inverse=True, return_counts=True)
    groups = []
    for u in torch.nonzero((counts >= 2) & (values >= 0)).flatten().tolist():
        members = torch.nonzero(inverse == u).flatten()  # [n]
        shortest = int(lens[members].min())
        offs = torch.arange(shortest, device=indices.device)
        rows = indices[indptr[members, None] + offs[None, :]]  # [n, shortest]
        same = (rows == rows[:1]).all(dim=0)  # [shortest]
        shared = int(same.int().cumprod(0).sum())  # < shortest: a request's new token is its own
        if shared >= min_shared:
            groups.append(SharedPrefix(members, rows[0, :shared].clone()))
            skip[members] = shared
    return SharingPlan(tuple(groups), indptr, indices, skip)


def shared_prefix_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    plan: SharingPlan,
    *,
    sm_scale: float,
    kept: KeptKV | None = None,
    layer: int = 0,
) -> torch.Tensor:  # [B, Hq, D] in q.dtype
    """Decode attention by `plan`: the remainders, then each shared prefix once per group,
    merged by log-sum-exp. With `kept`, the gathered K/V come from (and go to) its stores
    under keys (`layer`, bucket index)."""
    def rest_kv(i: int, bucket: PaddedRows) -> tuple[torch.Tensor, torch.Tensor]:
        if kept is None:
            return gather_bucket_kv(k_buffer, v_buffer, bucket)
        return kept.tails.get((layer, i), bucket, k_buffer, v_buffer)

    out, lse = attend_padded(q, plan.rest_padded, rest_kv, sm_scale=sm_scale)
    for i, bucket in enumerate(plan.decode_groups):
        kv = (
            kept.prefixes.get((layer, i), bucket, k_buffer, v_buffer)
            if kept is not None
            else gather_prefix_kv(k_buffer, v_buffer, bucket)
        )
        _merge_prefix(q, kv, bucket, out, lse, sm_scale)
    return out.to(q.dtype)


def shared_prefix_extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    qo_indptr: torch.Tensor,  # [B+1] int
    plan: SharingPlan,
    *,
    sm_scale: float,
) -> torch.Tensor:  # [T, Hq, D] in q.dtype
    """Extend attention by `plan` (made from the batch's kv metadata): a request outside
    every group runs the plain per-request reference; a grouped request attends causally
    to its remainder, then all of a group's new tokens attend to the shared prefix at once."""
    T, Hq, D = q.shape
    out = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    qo, rest = qo_indptr.tolist(), plan.rest_indptr.tolist()
    grouped = {int(b) for g in plan.groups for b in g.members}
    tails: dict[tuple[int, int], list[int]] = {}  # (new tokens, remainder) -> grouped requests
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        slots = plan.rest_indices[rest[b] : rest[b + 1]]
        if slots.numel() < q1 - q0:  # shared slots are computed KV, never a new token's
            raise ValueError(f"request {b}: {slots.numel()} unshared slots < {q1 - q0} new tokens")
        if b in grouped:
            tails.setdefault((q1 - q0, slots.numel()), []).append(b)
        else:
            out[q0:q1] = request_attention_ref(q[q0:q1], k_buffer, v_buffer, slots, sm_scale=sm_scale)
    for (n_new, _), members in tails.items():
        token_rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in members]).to(q.device)
        slots = torch.stack([plan.rest_indices[rest[b] : rest[b + 1]] for b in members])  # [m, R]
        o, s = _tail_attention(
            q.index_select(0, token_rows).view(len(members), n_new, Hq, D), k_buffer, v_buffer,
            slots, sm_scale,
        )
        out.index_copy_(0, token_rows, o.reshape(-1, Hq, D))
        lse.index_copy_(0, token_rows, s.reshape(-1, Hq))
    rows = [
        torch.cat([torch.arange(qo[b], qo[b + 1]) for b in g.members.tolist()]).to(q.device)
        for g in plan.groups
    ]
    for bucket in pad_groups(rows, [g.slots for g in plan.groups]):
        _merge_prefix(q, gather_prefix_kv(k_buffer, v_buffer, bucket), bucket, out, lse, sm_scale)
    return out.to(q.dtype)


def _merge_prefix(
    q: torch.Tensor,  # [T, Hq, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # `gather_prefix_kv` of the bucket
    bucket: PaddedGroups,
    out: torch.Tensor,  # [T, Hq, D] float32, contiguous: the rows' attention to the rest, updated
    lse: torch.Tensor,  # [T, Hq] float32, contiguous: its log-sum-exp (left as it is)
    sm_scale: float,
) -> None:
    """Attend the bucket's rows to their shared prefix and merge that into `out`: the two
    parts weigh by their shares of the total softmax mass, the prefix's being
    sigmoid(lse_prefix - lse_rest). A row belongs to one group, so it merges once and
    its total log-sum-exp is never needed. Works on (token, head) pairs in the prefix
    attention's order: the queries, `out` and `lse` are gathered in it and the merged
    rows scattered back, whatever the rows' batch order."""
    T, Hq, D = q.shape
    heads = bucket.query_heads(Hq, kv[0].shape[1])
    o_p, lse_p = _prefix_attention(q, kv, bucket, heads, sm_scale)  # [P, D], [P]
    if heads.keep is not None:  # padding rows
        o_p, lse_p = o_p.index_select(0, heads.keep), lse_p.index_select(0, heads.keep)
    flat_out = out.view(T * Hq, D)
    o_r = flat_out.index_select(0, heads.flat)
    share = torch.sigmoid(lse_p.sub_(lse.view(T * Hq).index_select(0, heads.flat))).unsqueeze(-1)  # [m, 1]
    flat_out.index_copy_(0, heads.flat, o_p.sub_(o_r).mul_(share).add_(o_r))


def _tail_attention(
    q: torch.Tensor,  # [m, Lq, Hq, D]: each request's last Lq tokens
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    slots: torch.Tensor,  # [m, R] int64, R >= Lq: each request's remainder
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [m, Lq, Hq, D], [m, Lq, Hq] float32
    """Causal attention of m requests' new tokens to the ends of their contexts, with the
    log-sum-exp, in one call: token i sees positions `0 ..= R - Lq + i` of its request's
    `slots`. A KV head's query rows are its G query heads times the Lq tokens."""
    m, Lq, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    G = Hq // Hkv
    R = slots.shape[1]
    k = gather_rows(k_buffer, slots.flatten()).view(m, R, Hkv, D).transpose(1, 2)  # [m, Hkv, R, D]
    v = gather_rows(v_buffer, slots.flatten()).view(m, R, Hkv, D).transpose(1, 2)  # [m, Hkv, R, D]
    qh = q.view(m, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(m, Hkv, G * Lq, D)
    seen = torch.arange(R, device=q.device)[None, :] <= torch.arange(Lq, device=q.device)[:, None] + (R - Lq)
    o, lse = attention_lse(qh, k, v, scale=sm_scale, valid=seen.repeat(G, 1))  # [m, Hkv, G*Lq, D], [m, Hkv, G*Lq]
    return (
        o.view(m, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4).reshape(m, Lq, Hq, D),
        lse.view(m, Hkv, G, Lq).permute(0, 3, 1, 2).reshape(m, Lq, Hq),
    )


def gather_prefix_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, D]
    bucket: PaddedGroups,
) -> tuple[torch.Tensor, torch.Tensor]:  # [g, Hkv, L, D] x2 float32, contiguous
    """The bucket's shared K and V, per group and KV head."""
    g, L = bucket.slots.shape
    Hkv, D = k_buffer.shape[1:]
    flat = bucket.slots.flatten()
    k = gather_rows(k_buffer, flat).float().view(g, L, Hkv, D).transpose(1, 2).contiguous()
    v = gather_rows(v_buffer, flat).float().view(g, L, Hkv, D).transpose(1, 2).contiguous()
    return k, v


def _prefix_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # `gather_prefix_kv` of the bucket
    bucket: PaddedGroups,
    heads: QueryHeads,  # the bucket's, for q's head counts
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [g*Hkv*n*G, D], [g*Hkv*n*G] float32
    """Every query head of every row of each group against the group's shared slots, in
    one call: per group and KV head, the query rows are its n rows times G query heads."""
    g, Hkv, n, G = heads.tokens.shape
    k, v = kv
    qh = q[heads.tokens, heads.heads].view(g, Hkv, n * G, q.shape[2])
    valid = None if bucket.slot_valid is None else bucket.slot_valid[:, None, None, :]
    o, lse = attention_lse(qh, k, v, scale=sm_scale, valid=valid)  # [g, Hkv, nG, D], [g, Hkv, nG]
    return o.reshape(-1, o.shape[-1]), lse.reshape(-1)
