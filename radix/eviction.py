"""Eviction policies: which unlocked leaf goes first. A registry, so a new policy never
touches the tree code."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sprig.radix.tree import TreeNode


class EvictionPolicy(Protocol):
    def priority(self, node: TreeNode) -> tuple:
        """Sort key; the leaf with the smallest key is evicted first."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def priority(self, node: TreeNode) -> tuple:
        return (node.last_access,)


class LFUPolicy:
    """Least frequently hit first; ties broken by recency."""

    def priority(self, node: TreeNode) -> tuple:
        return (node.hit_count, node.last_access)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(EVICTION_POLICIES)}") from None
