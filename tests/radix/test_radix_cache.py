"""Edge cases of the radix cache, eviction order, and the request helpers."""

from __future__ import annotations

import pytest
import torch

from sprig.radix import DisabledCache, IntegrityError, RadixCache, SlotAllocator, make_prefix_cache


def make(size: int = 64, page_size: int = 1, policy: str = "lru") -> RadixCache:
    return RadixCache(SlotAllocator(size, page_size, check=True), policy=policy)


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert `key` with fresh slots, freeing the duplicates as a caller must."""
    slots = cache.allocator.alloc(len(key))
    cached = cache.insert(key, slots)
    cache.allocator.free(slots[:cached])
    return slots


def test_empty_key() -> None:
    cache = make()
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    result = cache.match_prefix([])
    assert len(result) == 0 and result.last_node is cache.root
    cache.check_integrity()


def test_key_ending_at_node_boundary() -> None:
    cache = make()
    slots = put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5])
    result = cache.match_prefix([1, 2, 3])
    assert result.indices.tolist() == slots.tolist()
    assert len(result.last_node) == 3 and len(result.last_node.children) == 1
    cache.check_integrity()


def test_match_inside_edge_splits_it() -> None:
    cache = make()
    slots = put(cache, [1, 2, 3, 4])
    result = cache.match_prefix([1, 2, 9])
    assert result.indices.tolist() == slots[:2].tolist()
    assert len(result.last_node) == 2 and len(result.last_node.children) == 1
    assert cache.total_size() == 4
    cache.check_integrity()


def test_key_diverging_at_first_token() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    result = cache.match_prefix([7, 2, 3])
    assert len(result) == 0 and result.last_node is cache.root
    assert cache.insert([7, 2, 3], cache.allocator.alloc(3)) == 0
    assert len(cache.root.children) == 2
    cache.check_integrity()


def test_inserting_a_prefix_of_a_cached_key() -> None:
    cache = make()
    put(cache, [1, 2, 3, 4])
    dup = cache.allocator.alloc(2)
    assert cache.insert([1, 2], dup) == 2
    cache.allocator.free(dup)
    assert cache.total_size() == 4
    cache.check_integrity()


def test_reinserting_keeps_original_indices() -> None:
    cache = make()
    original = put(cache, [5, 6, 7])
    other = cache.allocator.alloc(3)
    assert cache.insert([5, 6, 7], other) == 3
    cache.allocator.free(other)
    assert cache.match_prefix([5, 6, 7]).indices.tolist() == original.tolist()
    cache.check_integrity()


def test_evict_zero_and_more_than_evictable() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    assert cache.evict(0) == 0
    assert cache.evict(1000) == 3
    assert cache.evict(1) == 0
    assert cache.allocator.available() == 64
    cache.check_integrity()


def test_locked_path_survives_eviction() -> None:
    cache = make()
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 8, 9])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3, 4]).indices.numel() == 4
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 4
    cache.check_integrity()


def test_unlock_below_zero_is_an_error() -> None:
    cache = make()
    put(cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(IntegrityError):
        cache.dec_lock_ref(node)


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    cache = make()
    put(cache, [1, 1])
    put(cache, [2, 2])
    put(cache, [3, 3])
    cache.match_prefix([1, 1])  # touch: now [2, 2] is the coldest
    assert cache.evict(1) == 2
    assert len(cache.match_prefix([2, 2])) == 0
    assert len(cache.match_prefix([1, 1])) == 2 and len(cache.match_prefix([3, 3])) == 2


def test_parent_becomes_candidate_after_its_last_child() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    put(cache, [9])
    cache.match_prefix([9])  # [9] is now the hottest
    assert cache.evict(4) == 4  # both children (1 each), then their parent [1, 2] (2)
    assert len(cache.match_prefix([9])) == 1
    assert cache.total_size() == 1


def test_lfu_evicts_least_hit_first() -> None:
    cache = make(policy="lfu")
    put(cache, [1])
    put(cache, [2])
    for _ in range(3):
        cache.match_prefix([1])
    cache.match_prefix([2])
    assert cache.evict(1) == 1
    assert len(cache.match_prefix([1])) == 1 and len(cache.match_prefix([2])) == 0


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        make(policy="mru")


def test_page_aligned_match_and_insert() -> None:
    cache = make(size=64, page_size=4)
    slots = cache.allocator.alloc(8)
    assert cache.insert(list(range(10)), torch.cat([slots, torch.tensor([0, 0])])) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(list(range(7))).indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([*range(6), 99, 98]).indices.tolist() == slots[:4].tolist()
    cache.check_integrity()


def test_hit_counters_in_tokens() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    cache.reset_counters()
    cache.match_prefix([1, 2, 3, 4])
    assert (cache.hit_tokens, cache.miss_tokens) == (3, 1)
    assert cache.hit_rate == pytest.approx(0.75)


def test_reset_flushes_and_refuses_while_locked() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and cache.allocator.available() == 64
    cache.check_integrity()


def test_integrity_detects_a_leak() -> None:
    cache = make()
    cache.allocator.alloc(3)
    with pytest.raises(IntegrityError, match="slot leak"):
        cache.check_integrity()
    cache.check_integrity(held_by_requests=3)


def test_request_lifecycle_helpers() -> None:
    """Prefill in two chunks, finish, then a second request reuses the prefix."""
    cache = make()
    prompt = [1, 2, 3, 4, 5, 6]
    match = cache.match_prefix(prompt)
    cache.inc_lock_ref(match.last_node)
    own = cache.allocator.alloc(6)
    # chunk 1: tokens 0..3 computed
    chunk = cache.cache_unfinished(prompt[:4], own[:4], prefix_len=0, last_node=match.last_node)
    assert chunk.indices.tolist() == own[:4].tolist()
    cache.check_integrity(held_by_requests=2)
    assert cache.protected_size() == 4
    # finish with 6 tokens of KV
    slots = torch.cat([chunk.indices, own[4:]])
    cache.cache_finished(prompt, slots, prefix_len=4, last_node=chunk.last_node)
    cache.check_integrity()
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    # a second request finds the whole prompt cached
    match = cache.match_prefix(prompt)
    assert len(match) == 6


def test_cache_unfinished_frees_duplicates() -> None:
    cache = make()
    put(cache, [1, 2, 3])
    match = cache.match_prefix([9])  # nothing cached for [1, 2, 3, 4] yet from this request's view
    cache.inc_lock_ref(match.last_node)
    mine = cache.allocator.alloc(4)
    result = cache.cache_unfinished([1, 2, 3, 4], mine, prefix_len=0, last_node=match.last_node)
    assert result.indices[:3].tolist() != mine[:3].tolist()  # the tree kept its originals
    assert result.indices[3] == mine[3]
    cache.check_integrity()
    cache.dec_lock_ref(result.last_node)


def test_disabled_cache_has_the_same_interface() -> None:
    alloc = SlotAllocator(16, check=True)
    cache = make_prefix_cache(alloc, enabled=False)
    assert isinstance(cache, DisabledCache)
    slots = alloc.alloc(4)
    result = cache.match_prefix([1, 2, 3, 4])
    assert len(result) == 0
    cache.inc_lock_ref(result.last_node)
    cache.check_integrity(held_by_requests=4)
    cache.cache_finished([1, 2, 3, 4], slots, prefix_len=0, last_node=result.last_node)
    assert cache.insert([1, 2], slots[:2]) == 0 and cache.evict(10) == 0
    cache.check_integrity()
    assert len(cache.match_prefix([1, 2, 3, 4])) == 0
