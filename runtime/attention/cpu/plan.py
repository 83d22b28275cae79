"""A step's plan: which requests share a cached prefix, what remains of each context, and
(for decode) how both are padded into buckets. Built once per step from that step's
metadata alone, every field at construction; the layers of the step read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sprig.runtime.attention.cpu.buckets import PaddedGroups, PaddedRows, pad_by_length, pad_groups

MIN_SHARED = 32  # a shared prefix shorter than this is attended per request


@dataclass(frozen=True)
class SharedPrefix:
    """Batch rows `members` (two or more) whose contexts all begin with the slots `slots`."""

    members: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [L] int64


@dataclass(frozen=True)
class SharingPlan:
    """A step's contexts split into shared prefixes and per-request remainders.

    Invariant: request b's context `kv_indices[kv_indptr[b]:kv_indptr[b+1]]` begins with
    its group's `slots` (`shared_lens[b]` of them; 0 for a request in no group); the rest,
    its remainder (`rest_starts[b]`, `rest_lens[b]` in `kv_indices`), is never empty for
    a grouped request: its newest token is its own. The requests in `alone` (an extend's
    with image blocks: `widened_requests`) are in no group; each is attended on its own.
    """

    groups: tuple[SharedPrefix, ...]
    kv_indices: torch.Tensor  # [N] int64
    shared_lens: torch.Tensor  # [B] int64
    rest_starts: torch.Tensor  # [B] int64
    rest_lens: torch.Tensor  # [B] int64
    alone: frozenset[int] = frozenset()

    @staticmethod
    def build(
        kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, min_shared: int = MIN_SHARED,
        alone: torch.Tensor | None = None,  # [B] bool: requests to keep out of every group
    ) -> SharingPlan:
        """Group requests that share at least `min_shared` leading slots (see `_groups`),
        all but those `alone` marks."""
        indptr = kv_indptr.to(torch.int64)
        indices = kv_indices.to(torch.int64)
        lens = indptr[1:] - indptr[:-1]  # [B]
        # a request kept alone is grouped as if it had no context: it joins no group
        groups = _groups(indptr, indices, lens if alone is None else lens.masked_fill(alone, 0), min_shared)
        shared = torch.zeros_like(lens)
        for g in groups:
            shared[g.members] = g.slots.numel()
        lone = frozenset() if alone is None else frozenset(torch.nonzero(alone).flatten().tolist())
        return SharingPlan(tuple(groups), indices, shared, indptr[:-1] + shared, lens - shared, lone)

    def rest(self, b: int) -> torch.Tensor:  # [rest_lens[b]] int64
        """Request b's remainder slots."""
        start = int(self.rest_starts[b])
        return self.kv_indices[start : start + int(self.rest_lens[b])]


def _groups(indptr: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor, min_shared: int) -> list[SharedPrefix]:
    """The groups, in order of their first slot. A candidate group is the requests whose
    context starts with the same slot; each member's common leading run with the group's
    first member (its leader) is measured, and the group shares the shortest run."""
    B = lens.numel()
    has_ctx = lens > 0
    if int(has_ctx.sum()) < 2:
        return []
    first = torch.where(has_ctx, indices[indptr[:-1].clamp(max=max(indices.numel() - 1, 0))], -1)  # [B]
    values, inverse, counts = torch.unique(first, return_inverse=True, return_counts=True)  # [U]
    candidate = (counts >= 2) & (values >= 0)  # [U]
    if not bool(candidate.any()):
        return []
    arange = torch.arange(B, device=lens.device)
    leader_of = torch.full_like(values, B).scatter_reduce(0, inverse, arange, "amin")[inverse]  # [B]
    followers = torch.nonzero(candidate[inverse] & (leader_of != arange)).flatten()  # [F]
    span = torch.minimum(lens[followers], lens[leader_of[followers]])  # [F]: positions both have
    W = int(span.max()) + 1
    windows = torch.cat([indices, indices.new_full((W,), -1)]).unfold(0, W, 1)  # [N+1, W]: windows[p] = slots p..p+W-1
    differ = windows.index_select(0, indptr[followers]) != windows.index_select(0, indptr[leader_of[followers]])  # [F, W]
    differ.scatter_(1, span[:, None], True)  # every row differs at its span's end at the latest
    run = differ.view(torch.uint8).argmax(dim=1)  # [F]: the first difference ends the common run
    shared = torch.full_like(values, 1 << 62).scatter_reduce(0, inverse[followers], run, "amin")  # [U]
    keep = candidate & (shared >= min_shared)  # [U]
    if not bool(keep.any()):
        return []
    chosen = torch.nonzero(keep).flatten()  # [G]
    members = torch.nonzero(keep[inverse]).flatten()  # rows of every chosen group ...
    members = members[torch.argsort(inverse[members], stable=True)]  # ... group after group, rows increasing
    sizes = counts[chosen]
    starts = indptr[members[sizes.cumsum(0) - sizes]].tolist()  # each group's first slot in kv_indices
    return [
        SharedPrefix(rows, indices[start : start + n])
        for rows, start, n in zip(members.split(sizes.tolist()), starts, shared[chosen].tolist(), strict=True)
    ]


def widened_requests(
    qo_indptr: torch.Tensor,  # [B+1] int
    kv_indptr: torch.Tensor,  # [B+1] int
    attend_until: torch.Tensor,  # [T] int64: `ForwardBatch.attend_until`
) -> torch.Tensor:  # [B] bool
    """The requests with a new token that `attend_until` lets see past its own position
    (one in an image block that goes on after it)."""
    qo = qo_indptr.to(torch.int64)
    kv = kv_indptr.to(torch.int64)
    q_lens = qo[1:] - qo[:-1]  # [B]
    B, T = q_lens.numel(), attend_until.numel()
    req = torch.repeat_interleave(torch.arange(B, device=qo.device), q_lens, output_size=T)  # [T]
    pos = torch.arange(T, device=qo.device) - qo[req] + (kv[1:] - kv[:-1] - q_lens)[req]  # [T] context positions
    wide = (attend_until > pos + 1).to(torch.int64)  # [T]
    return torch.zeros(B, dtype=torch.int64, device=qo.device).index_add_(0, req, wide) > 0


def window_bites(kv_indptr: torch.Tensor, window: int) -> bool:
    """Whether a sliding `window` hides some position from some token: whether a context
    is longer than it (its last token, which starts furthest in, then misses slot 0)."""
    return bool((kv_indptr[1:] - kv_indptr[:-1] > window).any())


def trim_to_window(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each context cut to its last `window` slots, all that its decode token sees: the
    cut contexts' (kv_indptr [B+1], kv_indices), int64."""
    indptr = kv_indptr.to(torch.int64)
    kept = (indptr[1:] - indptr[:-1]).clamp(max=window)  # [B]
    cut = torch.zeros_like(indptr)
    cut[1:] = kept.cumsum(0)
    total = int(cut[-1])
    # cut slot r of request b is slot r - cut[b] + (indptr[b+1] - kept[b]) of kv_indices
    shift = torch.repeat_interleave(indptr[1:] - kept - cut[:-1], kept, output_size=total)  # [total]
    return cut, kv_indices.to(torch.int64)[torch.arange(total, device=indptr.device) + shift]


@dataclass(frozen=True)
class DecodePlan:
    """A decode step's plan: the remainders bucketed by length (`rests`) and the shared
    prefixes padded into buckets whose query rows are batch rows (`prefixes`)."""

    sharing: SharingPlan
    rests: tuple[PaddedRows, ...]
    prefixes: tuple[PaddedGroups, ...]

    @staticmethod
    def build(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_heads: int, kv_heads: int) -> DecodePlan:
        sharing = SharingPlan.build(kv_indptr, kv_indices)
        groups = sharing.groups
        return DecodePlan(
            sharing,
            tuple(pad_by_length(sharing.rest_starts, sharing.rest_lens, sharing.kv_indices)),
            tuple(pad_groups([g.members for g in groups], [g.slots for g in groups], q_heads, kv_heads)),
        )
