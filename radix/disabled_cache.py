"""A prefix cache that caches nothing, with the `RadixCache` interface."""

from __future__ import annotations

import numpy as np
import torch

from sprig.radix.allocator import SlotAllocator
from sprig.radix.radix_cache import CachedPrefix, IntegrityError, MatchResult
from sprig.radix.tree import TokenIds, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class DisabledCache:
    """Every lookup misses; finished requests free all their slots; nothing is evictable.

    Useful as the baseline that shows what the radix cache saves.
    """

    def __init__(self, allocator: SlotAllocator, page_size: int | None = None, *, policy: str = "lru") -> None:
        del policy  # nothing to evict
        self.allocator = allocator
        self.page_size = allocator.page_size if page_size is None else page_size
        self.root = TreeNode(np.empty(0, np.int32), _EMPTY, None, 0)
        self.reset_counters()

    def reset_counters(self) -> None:
        self.hit_tokens = 0
        self.miss_tokens = 0

    def reset(self) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    @property
    def hit_rate(self) -> float:
        return 0.0

    def match_prefix(self, token_ids: TokenIds, *, record: bool = True) -> MatchResult:
        if record:
            self.record_lookup(0, len(token_ids))
        return MatchResult(_EMPTY, self.root)

    def record_lookup(self, hit_tokens: int, looked_up: int) -> None:
        self.hit_tokens += hit_tokens
        self.miss_tokens += looked_up - hit_tokens

    def insert(self, token_ids: TokenIds, indices: torch.Tensor) -> int:
        """Caches nothing: the caller keeps ownership of all of `indices`."""
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished(
        self, token_ids: TokenIds, slots: torch.Tensor, *, prefix_len: int, last_node: TreeNode
    ) -> None:
        self.allocator.free(slots)

    def cache_unfinished(
        self, token_ids: TokenIds, slots: torch.Tensor, *, prefix_len: int, last_node: TreeNode
    ) -> CachedPrefix:
        """Nothing moves: the request keeps all its slots and no tree prefix."""
        return CachedPrefix(_EMPTY, self.root)

    def drop_namespace(self, namespace: int) -> int:
        return 0

    def check_integrity(self, held_by_requests: int = 0) -> None:
        free = self.allocator.available()
        if free + held_by_requests != self.allocator.size:
            raise IntegrityError(
                f"slot leak: free {free} + held {held_by_requests} != total {self.allocator.size}"
            )
