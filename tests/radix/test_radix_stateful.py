"""Random insert / match / lock / unlock / evict / free against a brute-force model."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sprig.radix import RadixCache, SlotAllocator

KEYS = st.lists(st.integers(0, 3), min_size=0, max_size=14)


class RadixMachine(RuleBasedStateMachine):
    """The model: {page-aligned token prefix: slots of its last page}, prefix-closed."""

    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(64 * self.page_size, self.page_size, check=True)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locks: list[tuple[object, list[tuple[int, ...]]]] = []
        self.held: list[torch.Tensor] = []

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _pages(self, key: list[int]) -> list[tuple[int, ...]]:
        """The page-aligned prefixes of `key`, shortest first."""
        p = self.page_size
        return [tuple(key[:end]) for end in range(p, self._aligned(len(key)) + 1, p)]

    def _expected_match(self, key: list[int]) -> list[int]:
        out: list[int] = []
        for prefix in self._pages(key):
            if prefix not in self.model:
                break
            out.extend(self.model[prefix])
        return out

    def _sync_model_after_free(self) -> None:
        tree_slots = set()
        stack = [self.cache.root]
        while stack:
            node = stack.pop()
            tree_slots.update(node.value.tolist())
            stack.extend(node.children.values())
        self.model = {k: s for k, s in self.model.items() if s[0] in tree_slots}

    @rule(key=KEYS)
    def insert(self, key: list[int]) -> None:
        n = -(-len(key) // self.page_size) * self.page_size
        if self.alloc.available() < n:
            self.cache.evict(n - self.alloc.available())
            self._sync_model_after_free()
        slots = self.alloc.alloc(n)
        if slots is None:
            return
        expected_cached = len(self._expected_match(key))
        cached = self.cache.insert(key, slots[: len(key)])
        assert cached == expected_cached
        aligned = self._aligned(len(key))
        for prefix in self._pages(key)[cached // self.page_size :]:
            end = len(prefix)
            self.model[prefix] = tuple(slots[end - self.page_size : end].tolist())
        self.alloc.free(slots[:cached])
        self.alloc.free(slots[aligned:])

    @rule(key=KEYS)
    def match(self, key: list[int]) -> None:
        result = self.cache.match_prefix(key)
        assert result.indices.tolist() == self._expected_match(key)

    @rule(key=KEYS)
    def lock(self, key: list[int]) -> None:
        result = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(result.last_node)
        prefixes = self._pages(key)[: len(result) // self.page_size]
        self.locks.append((result.last_node, prefixes))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i: int) -> None:
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 80))
    def evict(self, n: int) -> None:
        before = self.cache.evictable_size()
        locked = {p: self.model[p] for _, ps in self.locks for p in ps}
        freed = self.cache.evict(n)
        assert freed >= min(n, before) and freed <= before
        assert self.cache.evictable_size() == before - freed
        self._sync_model_after_free()
        for prefix, slot in locked.items():
            assert self.model.get(prefix) == slot, "a locked token was evicted"
        for prefix in self.model:
            assert len(prefix) == self.page_size or prefix[: -self.page_size] in self.model

    @rule(n=st.integers(1, 8))
    def hold(self, n: int) -> None:
        slots = self.alloc.alloc(n * self.page_size)
        if slots is not None:
            self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def free_held(self, i: int) -> None:
        self.alloc.free(self.held.pop(i % len(self.held)))

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(held_by_requests=sum(t.numel() for t in self.held))
        assert self.cache.total_size() == len(self.model) * self.page_size

    def teardown(self) -> None:
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        for slots in self.held:
            self.alloc.free(slots)
        self.cache.evict(10**9)
        self.cache.check_integrity()
        assert self.alloc.available() == self.alloc.size
        assert self.cache.total_size() == 0


class PagedRadixMachine(RadixMachine):
    page_size = 4


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("machine", [RadixMachine, PagedRadixMachine], ids=["page1", "page4"])
def test_radix_matches_brute_force(machine: type[RadixMachine]) -> None:
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
