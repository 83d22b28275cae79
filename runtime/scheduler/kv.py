"""Where each request's KV lives: rows of the request-to-token table, slots from the
allocator, prefixes shared through the radix cache."""

from __future__ import annotations

import torch

from sprig.radix import DisabledCache, MatchResult, RadixCache, ReqToTokenPool, SlotAllocator
from sprig.runtime.multimodal.inputs import reusable_prefix
from sprig.runtime.scheduler.request import Req


class RequestKV:
    """The scheduler's KV bookkeeping. Holds integers and CPU index tensors only.

    Every slot is, at any idle moment, free, in the tree (evictable or protected), or
    owned by exactly one request (`Req.own_slots`): `check_integrity` verifies this.
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        cache: RadixCache | DisabledCache,
        req_to_token: ReqToTokenPool,
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.table = req_to_token
        self.page_size = allocator.page_size
        self.holders: set[Req] = set()

    def match(self, req: Req) -> MatchResult:
        """The cached prefix `req` may reuse: at least one token is always left to compute,
        and prompt positions whose logprobs are wanted are recomputed. A prefix ending inside
        an image after too few of its keys is cut back to the image's start
        (`multimodal.inputs.reusable_prefix`). Not counted in the hit rate: `admit` counts
        the look-up that serves the request."""
        match = self.cache.match_prefix(req.cache_key(self._lookup_len(req)), record=False)
        if req.images and (keep := reusable_prefix(len(match), req.images)) < len(match):
            match = self.cache.match_prefix(req.cache_key(keep), record=False)
        return match

    @staticmethod
    def _lookup_len(req: Req) -> int:
        limit = req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(0, req.logprob_start_len - 1))
        return limit

    def can_fit(self, tokens: int) -> bool:
        return self.allocator.available() + self.cache.evictable_size() >= self.pages(tokens)

    def pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole pages."""
        return -(-tokens // self.page_size) * self.page_size

    def admit(self, req: Req, match: MatchResult) -> bool:
        """Give `req` a table row holding its cached prefix, locked. False: no free row."""
        row = self.table.alloc()
        if row is None:
            return False
        n = len(match)
        self.table.write(row, 0, match.indices)
        self.cache.inc_lock_ref(match.last_node)
        self.cache.record_lookup(n, self._lookup_len(req))
        req.row, req.last_node = row, match.last_node
        req.prefix_len = req.kv_len = req.alloc_len = n
        req.cached_tokens += n
        self.holders.add(req)
        return True

    def reserve(self, req: Req, length: int) -> bool:
        """Make `table[row, :length]` usable slots, evicting cold cache if needed.
        False (nothing changed) if the pool cannot supply them."""
        need = self.pages(length) - req.alloc_len
        if need <= 0:
            return True
        slots = self._take(need)
        if slots is None:
            return False
        self.table.write(req.row, req.alloc_len, slots)
        req.alloc_len += need
        return True

    def reserve_all(self, reqs: list[Req]) -> bool:
        """`reserve(r, r.seq_len)` for every request of `reqs`, as one allocation and one
        table write. False (nothing changed) if the pool cannot supply them all."""
        needs = [self.pages(r.seq_len) - r.alloc_len for r in reqs]
        total = sum(n for n in needs if n > 0)
        if total == 0:
            return True
        if not self.can_fit(total):
            return False
        slots = self._take(total)
        if slots is None:
            return False
        rows: list[int] = []
        cols: list[int] = []
        grown = [(r, n) for r, n in zip(reqs, needs, strict=True) if n > 0]
        for r, n in grown:
            rows += [r.row] * n
            cols += range(r.alloc_len, r.alloc_len + n)
        self.table.write_at(torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64), slots)
        for r, n in grown:
            r.alloc_len += n
        return True

    def reserve_free(self, req: Req, length: int) -> bool:
        """`reserve(req, length)` only if the free list covers it without evicting cache."""
        need = self.pages(length) - req.alloc_len
        return need <= self.allocator.available() and self.reserve(req, length)

    def take_free(self, n: int) -> torch.Tensor | None:
        """`n` slots from the free list alone (never evicting cache), or None. The caller
        owns them until it frees them (`free`) or gives them to a request (`adopt`)
        within the same step."""
        return self.allocator.alloc(n) if n <= self.allocator.available() else None

    def free(self, slots: torch.Tensor) -> None:
        """Return slots from `take_free` to the free list."""
        if slots.numel():
            self.allocator.free(slots)

    def adopt(self, req: Req, start: int, slots: torch.Tensor) -> None:
        """Make `slots` (from `take_free`, page size 1) `req`'s slots of tokens `start ..`,
        freeing the slots it held there (`start >= req.prefix_len`: none in the tree)."""
        if self.page_size != 1 or start < req.prefix_len:
            raise ValueError("adopt needs page size 1 and positions past the cached prefix")
        end = start + slots.numel()
        held = min(end, req.alloc_len)
        if held > start:
            self.allocator.free(self.table.read(req.row, held, start).clone())  # a copy: the row is rewritten next
        self.table.write(req.row, start, slots)
        req.alloc_len = max(req.alloc_len, end)

    def shrink(self, req: Req) -> None:
        """Free `req`'s own slots past the pages its tokens need (rejected drafts)."""
        keep = max(self.pages(req.seq_len), req.prefix_len)
        if req.row is not None and req.alloc_len > keep:
            self.allocator.free(self.table.read(req.row, req.alloc_len, keep))
            req.alloc_len = keep

    def _take(self, n: int) -> torch.Tensor | None:
        """`n` slots from the allocator, evicting cold cache first if it has fewer free;
        None if even that cannot supply them."""
        short = n - self.allocator.available()
        if short > 0:
            self.cache.evict(short)
        return self.allocator.alloc(n)

    def cache_prefix(self, req: Req) -> None:
        """Put `req`'s computed tokens in the tree so others can share them; it keeps going."""
        ids = req.cache_key(req.kv_len)
        slots = self.table.read(req.row, req.alloc_len)
        kept = self.cache.cache_unfinished(ids, slots, prefix_len=req.prefix_len, last_node=req.last_node)
        self.table.write(req.row, 0, kept.indices)
        req.prefix_len, req.last_node = len(kept.indices), kept.last_node

    def release(self, req: Req) -> None:
        """`req` stops holding KV (finished, aborted or retracted): its computed tokens go to
        the tree, everything else is freed, its row and lock are released."""
        if req.row is None:
            return
        ids = req.cache_key(req.kv_len)
        slots = self.table.read(req.row, req.alloc_len)
        self.cache.cache_finished(ids, slots, prefix_len=req.prefix_len, last_node=req.last_node)
        self.table.free(req.row)
        self.holders.discard(req)
        req.row, req.last_node = None, None
        req.prefix_len = req.kv_len = req.alloc_len = 0

    def contexts(self, reqs: list[Req], ends: list[int]) -> torch.Tensor:
        """The slots of tokens `0 .. ends[i]-1` of each request, concatenated."""
        return self.table.read_many([r.row for r in reqs], ends)

    def check_integrity(self) -> None:
        self.cache.check_integrity(held_by_requests=sum(r.own_slots for r in self.holders))
