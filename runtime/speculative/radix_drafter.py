"""Radix-tree drafting: the prefix cache's continuations of a request's context.

Everything the tree holds is verified output of some finished request (or a prompt), so
finished sibling samples of `n > 1`, earlier branches and earlier turns sharing the
context are all candidate drafts. Where the cached continuations branch, the less-visited
ones are `alternatives`: a token tree whose paths the target verifies side by side.
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
        return next(iter(self._paths_from(context, k, 1)), [])

    def alternatives(self, context: Sequence[int], k: int, width: int) -> list[list[int]]:
        """At most `width` other paths of at most `k` tokens than `propose(context, k)`:
        below a branching of the cached continuations, the less-visited children (the
        branchings nearest the context first, each child followed down its most-visited
        path), or, where the context has left the tree, what followed the same suffix in
        other cached continuations. Each path starts where the draft does, shares a
        prefix with it, and differs from it and from every other."""
        return self._paths_from(context, k, width + 1)[1:]

    def _paths_from(self, context: Sequence[int], k: int, width: int) -> list[list[int]]:
        """The draft, then up to `width - 1` alternatives (see `alternatives`)."""
        if k <= 0:
            return []
        key = np.asarray(context, dtype=np.int32)
        node, rest = self._descend(key)
        if rest.shape[0] == 0:
            return self._tree(node, rest, k, width)
        child = self._child_starting(node, rest)
        if child is not None and common_prefix_len(child.key, rest) == rest.shape[0]:
            return self._tree(child, child.key[rest.shape[0] :], k, width)
        return [] if node is self.cache.root else self._from_siblings(node, key, k, width)

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
            node = max(node.children.values(), key=_visits)
            out += node.key[: k - len(out)].tolist()
        return out

    def _tree(self, node: TreeNode, edge_rest: np.ndarray, k: int, width: int) -> list[list[int]]:
        """`_follow`'s path, then up to `width - 1` paths that leave it at a branching
        below: nearest branchings first, more-visited children first."""
        path = edge_rest[:k].tolist()
        forks: list[tuple[int, TreeNode]] = []  # (tokens of the path before it, a child not taken)
        while len(path) < k and node.children:
            if width > 1:  # the ranking's first is `max`'s pick: the sort is stable
                ranked = sorted(node.children.values(), key=_visits, reverse=True)
                forks += [(len(path), child) for child in ranked[1:]]
                node = ranked[0]
            else:
                node = max(node.children.values(), key=_visits)
            path += node.key[: k - len(path)].tolist()
        out = [path]
        for depth, child in sorted(forks, key=lambda f: f[0])[: width - 1]:
            out.append(path[:depth] + self._follow(child, child.key, k - depth))
        return [p for i, p in enumerate(out) if p and p not in out[:i]]

    def _from_siblings(self, anchor: TreeNode, context: np.ndarray, k: int, width: int) -> list[list[int]]:
        """What followed the longest suffix of `context` (of `MIN_NGRAM..MAX_NGRAM` tokens)
        seen in the cached continuations of `anchor`: the first match of the most-visited
        continuation, then, up to `width` in all, what followed it in other continuations."""
        paths = list(self._paths(anchor))
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            suffix = context[-n:]
            out: list[list[int]] = []
            for path in paths:
                start = follows(path, suffix)
                if start is not None:
                    found = path[start : start + k].tolist()
                    if found and found not in out:
                        out.append(found)
                        if len(out) == width:
                            break
            if out:
                return out
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
            for child in sorted(node.children.values(), key=_visits):
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


def _visits(node: TreeNode) -> tuple[int, float]:
    """How a child ranks among its siblings: hits, then the most recent use."""
    return node.hit_count, node.last_access
