"""Radix-tree drafting: the prefix cache's continuations of a request's context.

Everything the tree holds is verified output of some finished request (or a prompt), so
finished sibling samples of `n > 1`, earlier branches and earlier turns sharing the
context are all candidate drafts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from sprig.radix import PrefixCache, TreeNode
from sprig.radix.tree import common_prefix_len
from sprig.runtime.speculative.ngram import follows

MAX_NGRAM, MIN_NGRAM = 4, 2  # suffix lengths looked up among the siblings' continuations
MAX_SCOPE_TOKENS = 4096  # of the siblings' continuations searched per proposal


class RadixDrafter:
    """Proposes the most-visited cached continuation of the context: the tree is walked
    along the context, then down the child with the most hits (the most recently used
    among equals). Where the context has left the tree (a sample that took another
    token than every cached sibling), it proposes what followed the context's latest
    2-4 tokens in the continuations cached below the point where it left (samples often
    come back together after a different word). Read-only: no access times, hit counts,
    splits or locks change."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        key = np.asarray(context, dtype=np.int32)
        node, rest = self._descend(key)
        if rest.shape[0] == 0:
            return self._follow(node, rest, k)
        child = self._child_starting(node, rest)
        if child is not None and common_prefix_len(child.key, rest) == rest.shape[0]:
            return self._follow(child, child.key[rest.shape[0] :], k)
        return [] if node is self.cache.root else self._from_siblings(node, key, k)

    def _descend(self, key: np.ndarray) -> tuple[TreeNode, np.ndarray]:
        """The deepest node whose whole path `key` begins with, and the rest of `key`."""
        node = self.cache.root
        while key.shape[0]:
            child = self._child_starting(node, key)
            if child is None or common_prefix_len(child.key, key) < len(child):
                break
            node, key = child, key[len(child) :]
        return node, key

    @staticmethod
    def _follow(node: TreeNode, edge_rest: np.ndarray, k: int) -> list[int]:
        """`edge_rest`, then down the most-visited children, `k` tokens at most."""
        out = edge_rest[:k].tolist()
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: (c.hit_count, c.last_access))
            out += node.key[: k - len(out)].tolist()
        return out

    def _from_siblings(self, anchor: TreeNode, context: np.ndarray, k: int) -> list[int]:
        """What followed the longest suffix of `context` (of `MIN_NGRAM..MAX_NGRAM` tokens)
        last seen in a cached continuation of `anchor`, the most visited first."""
        paths = list(self._paths(anchor))
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            suffix = context[-n:]
            for path in paths:
                start = follows(path, suffix)
                if start is not None:
                    return path[start : start + k].tolist()
        return []

    def _paths(self, anchor: TreeNode) -> Iterator[np.ndarray]:
        """Each leaf's tokens below `anchor`, most-visited branches first, `MAX_SCOPE_TOKENS`
        in all at most."""
        budget = MAX_SCOPE_TOKENS
        stack: list[tuple[TreeNode, list[np.ndarray]]] = [(anchor, [])]
        while stack and budget > 0:
            node, keys = stack.pop()
            if not node.children:
                path = np.concatenate(keys)[:budget] if keys else np.empty(0, dtype=np.int32)
                budget -= path.shape[0]
                yield path
                continue
            for child in sorted(node.children.values(), key=lambda c: (c.hit_count, c.last_access)):
                stack.append((child, [*keys, child.key]))

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
