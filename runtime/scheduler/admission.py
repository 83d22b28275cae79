"""Choosing the next prefill batch: which waiting requests enter, and how many of their
tokens are computed this step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sprig.radix.tree import common_prefix_len
from sprig.runtime.scheduler.config import SchedulerConfig, priority_rank
from sprig.runtime.scheduler.kv import RequestKV
from sprig.runtime.scheduler.policy import ORDERINGS_USING_MATCHES, SCHEDULE_ORDERINGS
from sprig.runtime.scheduler.request import Req


@dataclass
class Extend:
    """Compute `fill_ids[req.kv_len : req.kv_len + length]` of `req` this step."""

    req: Req
    length: int
    cached: int = 0  # prefix tokens reused from the cache when the request was admitted

    @property
    def completes(self) -> bool:
        """True when the step reaches the end of `fill_ids`: the next token gets sampled."""
        return self.req.kv_len + self.length == self.req.seq_len


def decode_reserve(req: Req, ratio: float) -> int:
    """Slots kept aside for `req`'s future decode tokens when admitting other work."""
    remaining = req.params.max_new_tokens - len(req.output_ids)
    return int(max(0, remaining) * ratio)


class Admission:
    """Builds prefill batches under the step's token budget and the pool's capacity."""

    def __init__(self, config: SchedulerConfig, kv: RequestKV) -> None:
        self.config = config
        self.kv = kv
        self.order = SCHEDULE_ORDERINGS[config.schedule_policy]
        self.order_uses_matches = config.schedule_policy in ORDERINGS_USING_MATCHES

    def build(self, waiting: list[Req], running: list[Req], chunked: Req | None, ratio: float) -> list[Extend]:
        """The extends of this prefill step (the caller removes their requests from its
        waiting queue). `waiting` holds the requests that may be admitted now.

        A request mid-way through a chunked prefill continues first. A new request enters
        when a table row is free, the step's token budget has room, and the pool can hold
        its extend plus the decode reserve of everyone running (`ratio` of their remaining
        `max_new_tokens`); with nothing running it enters whenever its extend fits.
        """
        budget = self.config.max_prefill_tokens
        reserved = sum(decode_reserve(r, ratio) for r in running)
        extends: list[Extend] = []
        if chunked is not None:
            ext = self._extend_for(chunked, budget)
            if not self.kv.reserve(chunked, chunked.kv_len + ext.length):
                return []
            extends.append(ext)
            budget -= ext.length
        if not waiting or budget <= 0 or (extends and not extends[-1].completes):
            return extends
        matches = {id(r): self.kv.match(r) for r in waiting} if self.order_uses_matches else {}
        busy = len(running) + len(extends)
        for req in self.ordered(waiting, matches):
            if budget <= 0 or busy >= self.config.max_running_requests:
                break
            match = self.kv.match(req)  # now: admitting others may have evicted part of it
            if self._shares_uncomputed_prefix(req, extends, len(match)):
                continue
            ext_len = req.extend_length(len(match), min(req.seq_len - len(match), budget, self._chunk_cap()))
            need = self.kv.pages(ext_len) + decode_reserve(req, ratio)
            if busy and not self.kv.can_fit(need + reserved + len(match)):
                break
            if not self.kv.admit(req, match):
                break
            if not self.kv.reserve(req, len(match) + ext_len):
                self.kv.release(req)
                break
            extends.append(Extend(req, ext_len, cached=len(match)))
            if not extends[-1].completes:
                break  # one chunked prefill at a time
            budget -= ext_len
            reserved += decode_reserve(req, ratio)
            busy += 1
        return extends

    def ordered(self, waiting: list[Req], matches: dict) -> list[Req]:
        """`waiting` in admission order: the schedule policy's, under priority scheduling
        after the priorities (a stable sort)."""
        order = self.order(waiting, matches, self.kv.cache.root)
        if not self.config.enable_priority_scheduling:
            return order
        low_first = self.config.schedule_low_priority_values_first
        return sorted(order, key=lambda r: priority_rank(r.priority, low_first))

    def blocked(self, req: Req, running: list[Req], ratio: float) -> bool:
        """Whether `running` leaves `req` no room to start now: every row is taken, or the
        pool (its cold cache evicted) cannot hold `req`'s first extend beside their decode
        reserve (`build`'s test for a request admitted first)."""
        if len(running) >= self.config.max_running_requests:
            return True
        if not running:
            return False
        match = self.kv.match(req)
        ext_len = min(req.seq_len - len(match), self.config.max_prefill_tokens, self._chunk_cap())
        need = self.kv.pages(ext_len) + decode_reserve(req, ratio) + len(match)
        return not self.kv.can_fit(need + sum(decode_reserve(r, ratio) for r in running))

    def _chunk_cap(self) -> int:
        size = self.config.chunked_prefill_size
        return size if size is not None else 1 << 62

    def _extend_for(self, req: Req, budget: int) -> Extend:
        length = min(req.seq_len - req.kv_len, max(1, budget), self._chunk_cap())
        return Extend(req, req.extend_length(req.kv_len, length))

    def _shares_uncomputed_prefix(self, req: Req, extends: list[Extend], cached: int) -> bool:
        """Whether `req` would recompute tokens another request of this step computes."""
        if not extends or cached >= req.seq_len:
            return False
        first = req.token_at(cached)
        ids: np.ndarray | None = None
        uncached = req.seq_len - cached
        for ext in extends:
            end = ext.req.kv_len + ext.length
            if end <= cached or ext.req.token_at(cached) != first:
                continue  # they part at or before `cached`: nothing uncomputed in common
            if ids is None:
                ids = np.asarray(req.fill_ids, dtype=np.int32)
            other = np.asarray(ext.req.fill_ids[:end], dtype=np.int32)
            # what waiting a step saves: the shared tokens, less the last one, which a
            # request computes itself anyway (it needs that token's logits)
            saved = min(common_prefix_len(ids, other) - cached, uncached - 1)
            if saved > 0 and saved >= min(self.config.in_batch_prefix_min, uncached - 1):
                return True
        return False
