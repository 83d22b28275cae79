"""Shared-prefix (cascade) attention: the torch backend's math for batches that share.

Requests that matched the same cached prefix hold the *same* KV slots for it: the radix
cache hands every match the slots of the one computed copy. Attention over such a group
reads the shared K/V once, as one matrix product for all the group's new tokens and query
heads (no mask: every new token comes after the prefix), then each request attends to the
rest of its own context, and the two partial results are merged by their log-sum-exp.
A request with image blocks (`SharingPlan.alone`) is attended on its own, by the
per-request reference given its `attend_until`.
The result equals plain attention up to float rounding; the K/V traffic for a prefix
shared by n requests drops n-fold. A soft-capped layer's scores (`softcap`) are capped in
every part: the cap is elementwise, so the merge stays exact. Attention sinks (`sinks`,
gpt-oss) add to a row's whole softmax denominator: they join once per row, after its
parts are merged (`add_sinks_`), or inside the per-request reference for rows it attends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sprig.kernels.attention_lse import add_sinks_, attention_lse
from sprig.kernels.paged import request_attention_ref
from sprig.radix.kv_cache import LayerKV
from sprig.runtime.attention.cpu.buckets import (
    BucketKV,
    PaddedGroups,
    attend_padded,
    gather_layer,
    gather_prefix_kv,
    pad_by_length,
    pad_groups,
)
from sprig.runtime.attention.cpu.plan import DecodePlan, SharingPlan

SHORT_EXTEND = 16  # most new tokens of an ungrouped request attended with others (not a prefill)

PrefixKV = Callable[[int, PaddedGroups], tuple[torch.Tensor, torch.Tensor]]
"""(bucket index, bucket) -> its shared K and V, `gather_prefix_kv`'s layout."""


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    plan: DecodePlan,
    rest_kv: BucketKV,
    prefix_kv: PrefixKV,
    *,
    sm_scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [B, Hq, D] in q.dtype
    """Decode attention by `plan`: the remainders (K/V from `rest_kv`), then each shared
    prefix once per group (K/V from `prefix_kv`), merged by log-sum-exp; scores capped by
    `softcap` when given, then every row given its head's sink when `sinks` are."""
    out, lse = attend_padded(q, list(plan.rests), rest_kv, sm_scale=sm_scale, softcap=softcap)
    for i, bucket in enumerate(plan.prefixes):
        _merge_prefix(q, prefix_kv(i, bucket), bucket, out, lse, sm_scale, softcap=softcap)
    if sinks is not None:
        add_sinks_(out, lse, sinks)
    return out.to(q.dtype)


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv: LayerKV,
    qo_indptr: torch.Tensor,  # [B+1] int
    plan: SharingPlan,
    *,
    sm_scale: float,
    softcap: float | None = None,
    attend_until: torch.Tensor | None = None,  # [T] int64: the batch's; required when plan.alone is not empty
    sinks: torch.Tensor | None = None,  # [Hq] float32
) -> torch.Tensor:  # [T, Hq, D] in q.dtype
    """Extend attention by `plan` (made from the batch's kv metadata), scores capped by
    `softcap` when given, each row given its head's sink once when `sinks` are (after the
    prefix merge; the per-request reference adds its own). A grouped request
    attends causally to its remainder (requests with the same shapes in one call), then
    all of a group's new tokens attend to the shared prefix at once. A request outside
    every group with at most `SHORT_EXTEND` new tokens after a cached context (a
    speculative verification, a short turn) attends with the others of its number of new
    tokens, their contexts padded into length buckets (`pad_by_length`) as decode's are;
    any other (a prompt's prefill) runs the plain per-request reference, which a request
    in `plan.alone` runs given its slice of `attend_until`."""
    if plan.alone and attend_until is None:
        raise ValueError("requests planned alone for their image blocks need the batch's attend_until")
    T, Hq, D = q.shape
    out = torch.empty((T, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((T, Hq), dtype=torch.float32, device=q.device)
    qo = qo_indptr.tolist()
    grouped = {int(b) for g in plan.groups for b in g.members}
    tails: dict[tuple[int, int], list[int]] = {}  # (new tokens, remainder) -> grouped requests
    short: dict[int, list[int]] = {}  # new tokens -> ungrouped requests with a cached context
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        if q1 == q0:
            continue
        rest = int(plan.rest_lens[b])
        if rest < q1 - q0:  # shared slots are computed KV, never a new token's
            raise ValueError(f"request {b}: {rest} unshared slots < {q1 - q0} new tokens")
        alone = b in plan.alone
        if b in grouped:
            tails.setdefault((q1 - q0, rest), []).append(b)
        elif not alone and q1 - q0 <= SHORT_EXTEND and rest > q1 - q0:
            short.setdefault(q1 - q0, []).append(b)
        else:
            out[q0:q1] = request_attention_ref(
                q[q0:q1], kv.k, kv.v, plan.rest(b),
                sm_scale=sm_scale, k_scale=kv.k_scale, v_scale=kv.v_scale, softcap=softcap,
                attend_until=attend_until[q0:q1] if alone else None, sinks=sinks,
            )
    for (n_new, _), members in tails.items():
        slots = torch.stack([plan.rest(b) for b in members])  # [m, R]
        _attend_tails(q, kv, qo, members, n_new, slots, None, out, lse, sm_scale, softcap=softcap)
    for n_new, members in short.items():
        chosen = torch.tensor(members, device=plan.rest_lens.device)
        for bucket in pad_by_length(plan.rest_starts[chosen], plan.rest_lens[chosen], plan.kv_indices):
            rows = [members[i] for i in bucket.rows.tolist()]
            _attend_tails(q, kv, qo, rows, n_new, bucket.slots, bucket.lens, out, lse, sm_scale, softcap=softcap)
    rows = [
        torch.cat([torch.arange(qo[b], qo[b + 1]) for b in g.members.tolist()]).to(q.device)
        for g in plan.groups
    ]
    for bucket in pad_groups(rows, [g.slots for g in plan.groups], Hq, kv.k.shape[1]):
        _merge_prefix(q, gather_prefix_kv(kv, bucket), bucket, out, lse, sm_scale, softcap=softcap)
    if sinks is not None:
        with_lse = [b for members in (*tails.values(), *short.values()) for b in members]
        _add_sinks_to_requests(out, lse, qo, with_lse, sinks)
    return out.to(q.dtype)


def _add_sinks_to_requests(
    out: torch.Tensor,  # [T, Hq, D] float32: the requests' rows updated
    lse: torch.Tensor,  # [T, Hq] float32: their log-sum-exp over their whole contexts
    qo: list[int],  # the batch's query offsets
    requests: list[int],  # the requests whose rows `out` and `lse` hold unsinked
    sinks: torch.Tensor,  # [Hq] float32
) -> None:
    """`add_sinks_` on the rows of `requests` only: the others' rows came from the
    per-request reference, with their sinks, and have no log-sum-exp here."""
    if not requests:
        return
    token_rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in requests]).to(out.device)
    sinked = add_sinks_(out.index_select(0, token_rows), lse.index_select(0, token_rows), sinks)
    out.index_copy_(0, token_rows, sinked)


def _merge_prefix(
    q: torch.Tensor,  # [T, Hq, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # `gather_prefix_kv` of the bucket
    bucket: PaddedGroups,
    out: torch.Tensor,  # [T, Hq, D] float32, contiguous: the rows' attention to the rest, updated
    lse: torch.Tensor,  # [T, Hq] float32, contiguous: its log-sum-exp, updated
    sm_scale: float,
    *,
    softcap: float | None,
) -> None:
    """Attend the bucket's rows to their shared prefix and merge that into `out` and
    `lse`: the two parts weigh by their shares of the total softmax mass, the prefix's
    being sigmoid(lse_prefix - lse_rest), and the total log-sum-exp (what a sink is
    weighed against) is logaddexp(lse_prefix, lse_rest). A row belongs to one group, so
    it merges once. Works on (token, head) pairs in the prefix attention's order: the
    queries, `out` and `lse` are gathered in it and the merged rows scattered back,
    whatever the rows' batch order."""
    T, Hq, D = q.shape
    heads = bucket.heads
    o_p, lse_p = _prefix_attention(q, kv, bucket, sm_scale, softcap)  # [P, D], [P]
    if heads.keep is not None:  # padding rows
        o_p, lse_p = o_p.index_select(0, heads.keep), lse_p.index_select(0, heads.keep)
    flat_out, flat_lse = out.view(T * Hq, D), lse.view(T * Hq)
    o_r, lse_r = flat_out.index_select(0, heads.flat), flat_lse.index_select(0, heads.flat)
    total = torch.logaddexp(lse_p, lse_r)  # [m]
    share = torch.sigmoid(lse_p.sub_(lse_r)).unsqueeze(-1)  # [m, 1]
    flat_out.index_copy_(0, heads.flat, o_p.sub_(o_r).mul_(share).add_(o_r))
    flat_lse.index_copy_(0, heads.flat, total)


def _prefix_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv: tuple[torch.Tensor, torch.Tensor],  # `gather_prefix_kv` of the bucket
    bucket: PaddedGroups,
    sm_scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [g*Hkv*n*G, D], [g*Hkv*n*G] float32
    """Every query head of every row of each group against the group's shared slots, in
    one call: per group and KV head, the query rows are its n rows times G query heads."""
    heads = bucket.heads
    g, Hkv, n, G = heads.tokens.shape
    k, v = kv
    qh = q[heads.tokens, heads.heads].view(g, Hkv, n * G, q.shape[2])
    valid = None if bucket.slot_valid is None else bucket.slot_valid[:, None, None, :]
    o, lse = attention_lse(qh, k, v, scale=sm_scale, valid=valid, softcap=softcap)  # [g, Hkv, nG, D], [g, Hkv, nG]
    return o.reshape(-1, o.shape[-1]), lse.reshape(-1)


def _attend_tails(
    q: torch.Tensor,  # [T, Hq, D]
    kv: LayerKV,
    qo: list[int],  # the batch's query offsets
    members: list[int],  # requests with n_new new tokens each
    n_new: int,
    slots: torch.Tensor,  # [m, R] int64: each member's slots in position order, padded
    lens: torch.Tensor | None,  # [m] int64: each member's real slots (None: R each)
    out: torch.Tensor,  # [T, Hq, D] float32: the members' rows written
    lse: torch.Tensor,  # [T, Hq] float32: the members' rows written
    sm_scale: float,
    *,
    softcap: float | None,
) -> None:
    """`_tail_attention` of the members' new tokens, written at their rows of `out`, `lse`."""
    Hq, D = q.shape[1:]
    token_rows = torch.cat([torch.arange(qo[b], qo[b + 1]) for b in members]).to(q.device)
    rows_q = q.index_select(0, token_rows).view(len(members), n_new, Hq, D)
    o, s = _tail_attention(rows_q, kv, slots, lens, sm_scale, softcap)
    out.index_copy_(0, token_rows, o.reshape(-1, Hq, D))
    lse.index_copy_(0, token_rows, s.reshape(-1, Hq))


def _tail_attention(
    q: torch.Tensor,  # [m, Lq, Hq, D]: each request's last Lq tokens
    kv: LayerKV,
    slots: torch.Tensor,  # [m, R] int64, R >= Lq: each request's remainder, padded past lens
    lens: torch.Tensor | None,  # [m] int64, Lq <= lens <= R: its real length (None: R each)
    sm_scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [m, Lq, Hq, D], [m, Lq, Hq] float32
    """Causal attention of m requests' new tokens to the ends of their contexts, with the
    log-sum-exp, in one call: token i of request j sees positions `0 ..= lens[j] - Lq + i`
    of its `slots` (padding never). A KV head's query rows are its G query heads times
    the Lq tokens."""
    m, Lq, Hq, D = q.shape
    Hkv = kv.k.shape[1]
    G = Hq // Hkv
    R = slots.shape[1]
    k, v = gather_layer(kv, slots.flatten())
    k = k.view(m, R, Hkv, D).transpose(1, 2)  # [m, Hkv, R, D]
    v = v.view(m, R, Hkv, D).transpose(1, 2)  # [m, Hkv, R, D]
    qh = q.view(m, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(m, Hkv, G * Lq, D)
    last = torch.arange(Lq, device=q.device) - Lq  # [Lq]: token i's offset from the context's end
    if lens is None:
        seen = (torch.arange(R, device=q.device)[None, :] <= last[:, None] + R).repeat(G, 1)  # [G*Lq, R]
    else:
        ends = lens.to(q.device)[:, None, None] + last[None, :, None]  # [m, Lq, 1]
        seen = (torch.arange(R, device=q.device)[None, None, :] <= ends).repeat(1, G, 1)[:, None]  # [m, 1, G*Lq, R]
    o, lse = attention_lse(qh, k, v, scale=sm_scale, valid=seen, softcap=softcap)  # [m, Hkv, G*Lq, D], [m, Hkv, G*Lq]
    return (
        o.view(m, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4).reshape(m, Lq, Hq, D),
        lse.view(m, Hkv, G, Lq).permute(0, 3, 1, 2).reshape(m, Lq, Hq),
    )
