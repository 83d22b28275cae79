"""Radix-tree drafting: the prefix cache's continuations of a request's context.

Everything the tree holds is verified output of some finished request (or a prompt), so
finished sibling samples of `n > 1`, earlier branches and earlier turns sharing the
context are all candidate drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sprig.radix import PrefixCache, TreeNode
from sprig.radix.tree import common_prefix_len


class RadixDrafter:
    """Proposes the most-visited cached continuation of the context: the tree is walked
    along the context, then down the child with the most hits (the most recently used
    among equals). Read-only: no access times, hit counts, splits or locks change."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        key = np.asarray(context, dtype=np.int32)
        node, tail = self._walk(self.cache.root, key)
        if node is None:
            return []
        out = tail[:k].tolist()
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: (c.hit_count, c.last_access))
            out += node.key[: k - len(out)].tolist()
        return out

    def _walk(self, node: TreeNode, key: np.ndarray) -> tuple[TreeNode | None, np.ndarray]:
        """Where `key` ends in the tree: the node at or below its end, and the rest of that
        node's edge after it (empty at a node boundary); None if `key` leaves the tree."""
        while key.shape[0]:
            child = self._child_starting(node, key)
            if child is None:
                return None, key[:0]
            n = common_prefix_len(child.key, key)
            if n == key.shape[0]:
                return child, child.key[n:]
            if n < len(child):
                return None, key[:0]
            node, key = child, key[n:]
        return node, key

    def _child_starting(self, node: TreeNode, key: np.ndarray) -> TreeNode | None:
        """The child whose edge begins like `key` (children are filed by first page; a
        key shorter than a page is compared against every child)."""
        page = self.cache.page_size
        if page == 1:
            return node.children.get(int(key[0]))
        if key.shape[0] >= page:
            return node.children.get(key[:page].tobytes())
        for child in node.children.values():
            if np.array_equal(child.key[: key.shape[0]], key):
                return child
        return None
