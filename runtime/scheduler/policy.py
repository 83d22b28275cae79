"""Orders in which waiting requests are admitted. A registry: name -> ordering function."""

from __future__ import annotations

from collections.abc import Callable

from sprig.radix import MatchResult, TreeNode
from sprig.runtime.scheduler.request import Req

Ordering = Callable[[list[Req], dict[int, MatchResult], TreeNode], list[Req]]


def fcfs(waiting: list[Req], matches: dict[int, MatchResult], root: TreeNode) -> list[Req]:
    """Arrival order (retracted requests keep their original arrival time)."""
    return sorted(waiting, key=lambda r: r.arrival)


def longest_prefix_match(waiting: list[Req], matches: dict[int, MatchResult], root: TreeNode) -> list[Req]:
    """Longest cached prefix first; ties in arrival order."""
    return sorted(waiting, key=lambda r: (-len(matches[id(r)]), r.arrival))


def dfs_weight(waiting: list[Req], matches: dict[int, MatchResult], root: TreeNode) -> list[Req]:
    """Depth-first over the radix tree, heavier subtrees (more waiting requests) first.

    Requests sharing a cached prefix come out adjacent, so the prefix is used by all of
    them while it is hot instead of being evicted between them.
    """
    at_node: dict[int, list[Req]] = {}
    weight: dict[int, int] = {}
    for req in sorted(waiting, key=lambda r: r.arrival):
        node = matches[id(req)].last_node
        at_node.setdefault(id(node), []).append(req)
        while node is not None:
            weight[id(node)] = weight.get(id(node), 0) + 1
            node = node.parent
    order: list[Req] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.extend(at_node.get(id(node), ()))
        children = [c for c in node.children.values() if id(c) in weight]
        children.sort(key=lambda c: weight[id(c)])  # lightest pushed first, heaviest popped first
        stack.extend(children)
    return order


SCHEDULE_ORDERINGS: dict[str, Ordering] = {
    "fcfs": fcfs,
    "lpm": longest_prefix_match,
    "dfs-weight": dfs_weight,
}
ORDERINGS_USING_MATCHES = frozenset({"lpm", "dfs-weight"})  # the others never read `matches`
