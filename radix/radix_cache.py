"""The radix-tree prefix cache: token-id sequences mapped to the KV slots that hold them."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from sprig.radix.allocator import SlotAllocator
from sprig.radix.eviction import EvictionPolicy, make_policy
from sprig.radix.tree import TokenIds, TreeNode, as_key, common_prefix_len, namespace_of

_EMPTY = torch.empty(0, dtype=torch.int64)


class IntegrityError(RuntimeError):
    """The KV accounting or the tree's shape is broken."""


@dataclass
class MatchResult:
    """Slots of the longest cached prefix (int64) and the node where the match ended.

    Lock `last_node` (`inc_lock_ref`) before relying on `indices`: unlocked KV may be
    evicted by the next allocation.
    """

    indices: torch.Tensor
    last_node: TreeNode

    def __len__(self) -> int:
        return self.indices.numel()


@dataclass
class CachedPrefix:
    """What `cache_unfinished` hands back: the request now holds `last_node` locked and
    its first `len(indices)` tokens live in the tree's slots `indices`."""

    indices: torch.Tensor
    last_node: TreeNode


class RadixCache:
    """A radix tree over the slots of `allocator`, with page-granular keys.

    Invariants (checked by `check_integrity`):
    - every node but the root has a non-empty key, a multiple of `page_size` long, and
      a value of the same length; a child is filed under its key's first page;
    - `evictable_size() + protected_size() == total_size()`: tokens in nodes with
      `lock_ref == 0` and `> 0`;
    - `free + evictable + protected + held-by-requests == allocator.size`.
    """

    def __init__(self, allocator: SlotAllocator, page_size: int | None = None, *, policy: str = "lru") -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size if page_size is None else page_size
        if self.page_size != allocator.page_size:
            raise ValueError(f"page_size {self.page_size} differs from the allocator's {allocator.page_size}")
        self.policy: EvictionPolicy = make_policy(policy)
        self.reset_counters()
        self._init_tree()

    # ---------------------------------------------------------------- state
    def _init_tree(self) -> None:
        self._clock = 0
        self.root = TreeNode(np.empty(0, np.int32), _EMPTY, None, 0)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._leaves: set[TreeNode] = set()  # evictable leaves: unlocked, childless, not root

    def reset_counters(self) -> None:
        self.hit_tokens = 0
        self.miss_tokens = 0

    def reset(self) -> None:
        """Flush: free every cached slot. Only valid when no request holds a lock."""
        if self._protected:
            raise RuntimeError(f"cannot flush: {self._protected} cached tokens are locked by requests")
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            self.allocator.free(node.value)
            stack.extend(node.children.values())
        self._init_tree()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def hit_rate(self) -> float:
        looked_up = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / looked_up if looked_up else 0.0

    # ---------------------------------------------------------------- keys
    def _child_key(self, key: np.ndarray) -> int | bytes:
        return int(key[0]) if self.page_size == 1 else key[: self.page_size].tobytes()

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---------------------------------------------------------------- match / insert
    def match_prefix(self, token_ids: TokenIds, *, record: bool = True) -> MatchResult:
        """The longest cached prefix of `token_ids` (page-aligned) and its last node.

        Splits an edge when the match ends inside it; refreshes access times along the
        path; counts hit and missed tokens unless `record` is False (a look that does not
        serve a request, such as ordering a queue).
        """
        key = as_key(token_ids)
        result = self._match(key)
        if record:
            self.record_lookup(len(result), key.shape[0])
        return result

    def record_lookup(self, hit_tokens: int, looked_up: int) -> None:
        """Count a look-up of `looked_up` tokens of which `hit_tokens` were cached."""
        self.hit_tokens += hit_tokens
        self.miss_tokens += looked_up - hit_tokens

    def _match(self, key: np.ndarray) -> MatchResult:
        key = key[: self._aligned(key.shape[0])]
        node, values, now = self.root, [], self._tick()
        while key.shape[0]:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._aligned(common_prefix_len(child.key, key))
            child.last_access = now
            child.hit_count += 1
            if n < len(child):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        indices = torch.cat(values) if values else _EMPTY
        return MatchResult(indices, node)

    def insert(self, token_ids: TokenIds, indices: torch.Tensor) -> int:
        """Cache `token_ids` (truncated to whole pages) at slots `indices`.

        Returns how many leading tokens were already cached: the tree keeps its own
        slots for that span, and the caller must free its duplicates
        `indices[:returned]` that it owns. The rest of `indices` now belongs to the tree.
        """
        key = as_key(token_ids)
        if indices.numel() < key.shape[0]:
            raise ValueError(f"{key.shape[0]} tokens but only {indices.numel()} slots")
        n_total = self._aligned(key.shape[0])
        key, value = key[:n_total], indices[:n_total].to(torch.int64)
        node, done, now = self.root, 0, self._tick()
        while done < n_total:
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                self._add_leaf(node, rest.copy(), value[done:].clone(), now)
                break
            n = self._aligned(common_prefix_len(child.key, rest))
            child.last_access = now
            if n < len(child):
                child = self._split(child, n)
            node, done = child, done + n
        return done

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, value: torch.Tensor, now: int) -> None:
        leaf = TreeNode(key, value, parent, now)
        parent.children[self._child_key(key)] = leaf
        self._evictable += len(leaf)
        self._leaves.discard(parent)
        self._leaves.add(leaf)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child)
        upper = TreeNode(child.key[:n], child.value[:n], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ---------------------------------------------------------------- locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one lock taken by `inc_lock_ref(node)`."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise IntegrityError(f"dec_lock_ref below zero on {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node)
                self._protected -= len(node)
                if node.is_leaf:
                    self._leaves.add(node)
            node = node.parent

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible, coldest unlocked leaves first.

        Returns the number of slots freed (less than asked when nothing more is
        evictable). A parent becomes a candidate once its last child is gone.
        """
        if num_tokens <= 0 or not self._leaves:
            return 0
        heap = [(self.policy.priority(leaf), leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self._remove_leaf(leaf)
            freed += len(leaf)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.priority(parent), parent))
        return freed

    def _remove_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        del parent.children[self._child_key(leaf.key)]
        self.allocator.free(leaf.value)
        self._evictable -= len(leaf)
        self._leaves.discard(leaf)
        if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
            self._leaves.add(parent)

    def drop_namespace(self, namespace: int) -> int:
        """Free every cached prefix of `namespace` (`tree.namespaced`); returns the slots
        freed. RuntimeError if a request holds one of them locked."""
        doomed = [child for child in self.root.children.values() if namespace_of(child.key) == namespace]
        nodes, stack = [], list(doomed)
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise RuntimeError(f"cannot drop namespace {namespace}: a request holds its prefix {node!r}")
            nodes.append(node)
            stack.extend(node.children.values())
        for child in doomed:
            del self.root.children[self._child_key(child.key)]
        for node in nodes:
            self.allocator.free(node.value)
            self._evictable -= len(node)
            self._leaves.discard(node)
        return sum(len(node) for node in nodes)

    # ---------------------------------------------------------------- request helpers
    def cache_finished(
        self, token_ids: TokenIds, slots: torch.Tensor, *, prefix_len: int, last_node: TreeNode
    ) -> None:
        """A request is done: the tree takes its KV, its duplicates are freed, its lock moves off.

        `slots[i]` holds the KV of `token_ids[i]`; the first `prefix_len` slots came from
        the tree (matched and locked at `last_node`), the rest are the request's own.
        """
        n = self._aligned(len(token_ids))
        cached = self.insert(token_ids[:n], slots[:n])
        self.allocator.free(slots[prefix_len:cached])
        self.allocator.free(slots[n:])
        self.dec_lock_ref(last_node)

    def cache_unfinished(
        self, token_ids: TokenIds, slots: torch.Tensor, *, prefix_len: int, last_node: TreeNode
    ) -> CachedPrefix:
        """Cache a request that goes on (a prefill chunk, a chat turn to continue).

        Same ownership rules as `cache_finished`, but the request keeps a lock on the
        new last node and must use the returned `indices` for its first tokens (its own
        duplicates were freed). Slots past the last whole page stay the request's own.
        """
        key = as_key(token_ids)
        n = self._aligned(key.shape[0])
        cached = self.insert(key[:n], slots[:n])
        self.allocator.free(slots[prefix_len:cached])
        match = self._match(key[:n])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(last_node)
        return CachedPrefix(match.indices, match.last_node)

    # ---------------------------------------------------------------- checks
    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Raise `IntegrityError` unless the KV accounting and the tree's shape are exact.

        `held_by_requests`: slots owned by running requests outside the tree.
        """
        evictable = protected = 0
        leaves: set[TreeNode] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                if child.parent is not node:
                    raise IntegrityError(f"{child!r} has a wrong parent")
                if len(child) == 0 or len(child) % self.page_size or child.value.numel() != len(child):
                    raise IntegrityError(f"{child!r} has an empty, unaligned or mismatched key/value")
                if ck != self._child_key(child.key):
                    raise IntegrityError(f"{child!r} is filed under a key that is not its first page")
                if child.lock_ref < 0:
                    raise IntegrityError(f"{child!r} has a negative lock_ref")
                if child.lock_ref > node.lock_ref and node is not self.root:
                    raise IntegrityError(f"{child!r} is locked more than its parent")
                if child.lock_ref:
                    protected += len(child)
                else:
                    evictable += len(child)
                    if child.is_leaf:
                        leaves.add(child)
                stack.append(child)
        if (evictable, protected) != (self._evictable, self._protected):
            raise IntegrityError(
                f"sizes drifted: counted evictable={evictable} protected={protected}, "
                f"tracked {self._evictable} and {self._protected}"
            )
        if leaves != self._leaves:
            raise IntegrityError("the evictable-leaf set differs from the tree")
        free = self.allocator.available()
        if free + evictable + protected + held_by_requests != self.allocator.size:
            raise IntegrityError(
                f"slot leak: free {free} + evictable {evictable} + protected {protected} "
                f"+ held {held_by_requests} != total {self.allocator.size}"
            )
