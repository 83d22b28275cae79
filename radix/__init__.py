"""sprig.radix: the radix-tree prefix cache over a paged KV pool.

- `SlotAllocator`: free list of KV slot indices (slot/page 0 reserved as padding).
- `ReqToTokenPool`: `[max_running_requests, max_context_len]` int32 request→slot table.
- `KVCache`, `KVShape`, `LayerKV`, `slots_for_budget`: per-layer K/V buffers (float, or
  int8 / fp8 with per token-head scales: `KV_CACHE_DTYPES`) and their sizing.
- `RadixCache` / `DisabledCache`: prefix caches with one interface; `make_prefix_cache`.
"""

from sprig.radix.allocator import AllocatorError, SlotAllocator
from sprig.radix.disabled_cache import DisabledCache
from sprig.radix.eviction import EVICTION_POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy
from sprig.radix.kv_cache import KV_CACHE_DTYPES, KVCache, KVShape, LayerKV, slots_for_budget
from sprig.radix.radix_cache import CachedPrefix, IntegrityError, MatchResult, RadixCache
from sprig.radix.req_to_token import ReqToTokenPool
from sprig.radix.tree import TreeNode

PrefixCache = RadixCache | DisabledCache


def make_prefix_cache(
    allocator: SlotAllocator, *, enabled: bool = True, policy: str = "lru"
) -> RadixCache | DisabledCache:
    """A `RadixCache` over `allocator`, or a `DisabledCache` when `enabled` is False."""
    cls = RadixCache if enabled else DisabledCache
    return cls(allocator, policy=policy)


__all__ = [
    "EVICTION_POLICIES",
    "KV_CACHE_DTYPES",
    "AllocatorError",
    "CachedPrefix",
    "DisabledCache",
    "EvictionPolicy",
    "IntegrityError",
    "KVCache",
    "KVShape",
    "LFUPolicy",
    "LRUPolicy",
    "LayerKV",
    "MatchResult",
    "PrefixCache",
    "RadixCache",
    "ReqToTokenPool",
    "SlotAllocator",
    "TreeNode",
    "make_prefix_cache",
    "slots_for_budget",
]
