"""Replay a synthetic prefix-sharing trace through sprig's radix cache and a naive cache.

The trace mixes the workloads sprig is built for: a few-shot prefix shared by many
requests, best-of-N branches, a depth-4 fan-out-4 tree search, and multi-turn chats,
about a million tokens inserted into a bounded pool, so eviction runs throughout.

Each request does what the scheduler does: match its prompt, lock the match, allocate
slots for the rest (evicting when the pool is short), insert, unlock.

The naive reference is a per-token trie (one dict node per token, a Python loop per token)
with the same LRU policy. Both caches replay the same trace on the same machine; the
script prints operations per second for each and the ratios.

    python benchmarks/bench_radix.py [--scale 1.0] [--pool 150000] [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sprig.radix import RadixCache, SlotAllocator


def build_trace(scale: float, seed: int) -> list[np.ndarray]:
    """Requests (token-id arrays) of four interleaved workloads."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, 32000, n, dtype=np.int32)

    def fewshot():
        prefix = tokens(1500)
        for _ in range(int(150 * scale)):
            yield np.concatenate([prefix, tokens(150)])

    def best_of_n():
        for _ in range(int(40 * scale)):
            prompt = tokens(300)
            for _ in range(8):
                yield np.concatenate([prompt, tokens(100)])

    def tree_search():
        for _ in range(max(1, int(4 * scale))):
            frontier = [tokens(200)]
            for _depth in range(4):
                children = []
                for node in frontier:
                    for _ in range(4):
                        child = np.concatenate([node, tokens(40)])
                        children.append(child)
                        yield child
                frontier = children

    def chats():
        for _ in range(int(60 * scale)):
            history = tokens(100)
            for _turn in range(8):
                history = np.concatenate([history, tokens(120)])
                yield history

    streams = [fewshot(), best_of_n(), tree_search(), chats()]
    pick = random.Random(seed)
    trace = []
    while streams:
        stream = pick.choice(streams)
        try:
            trace.append(next(stream))
        except StopIteration:
            streams.remove(stream)
    return trace


# --------------------------------------------------------------------------- naive baseline
@dataclass(eq=False)
class _Node:
    parent: _Node | None
    token: int
    slot: int
    children: dict[int, _Node] = field(default_factory=dict)
    lock: int = 0
    last: int = 0


class NaiveTrie:
    """One node per token; LRU eviction of unlocked leaves. The obvious implementation."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.root = _Node(None, -1, 0, lock=1)
        self.clock = itertools.count()
        self.hit_tokens = 0
        self.miss_tokens = 0

    def match_prefix(self, key: np.ndarray) -> tuple[list[int], _Node]:
        node, slots, now = self.root, [], next(self.clock)
        for tok in key.tolist():
            child = node.children.get(tok)
            if child is None:
                break
            child.last = now
            slots.append(child.slot)
            node = child
        self.hit_tokens += len(slots)
        self.miss_tokens += len(key) - len(slots)
        return slots, node

    def insert(self, key: np.ndarray, slots: torch.Tensor) -> int:
        node, now, cached = self.root, next(self.clock), 0
        for i, (tok, slot) in enumerate(zip(key.tolist(), slots.tolist(), strict=True)):
            child = node.children.get(tok)
            if child is None:
                child = _Node(node, tok, slot)
                node.children[tok] = child
            else:
                cached = i + 1
            child.last = now
            node = child
        return cached

    def lock(self, node: _Node, delta: int) -> None:
        while node is not self.root:
            node.lock += delta
            node = node.parent

    def evict(self, n: int) -> int:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.lock == 0 and node is not self.root:
                leaves.append((node.last, id(node), node))
        heapq.heapify(leaves)
        freed = []
        while len(freed) < n and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.token]
            freed.append(leaf.slot)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last, id(parent), parent))
        self.allocator.free(torch.tensor(freed, dtype=torch.int64))
        return len(freed)


# --------------------------------------------------------------------------- replay
@dataclass
class Stats:
    name: str
    matches: int = 0
    match_s: float = 0.0
    inserts: int = 0
    inserted_tokens: int = 0
    insert_s: float = 0.0
    evicted_tokens: int = 0
    evict_s: float = 0.0
    hit_rate: float = 0.0


def replay(name: str, trace: list[np.ndarray], pool: int) -> Stats:
    allocator = SlotAllocator(pool)
    radix = name == "radix"
    cache = RadixCache(allocator) if radix else NaiveTrie(allocator)
    stats = Stats(name)
    clock = time.perf_counter
    for key in trace:
        t0 = clock()
        if radix:
            match = cache.match_prefix(key)
            cached, node = len(match), match.last_node
            cache.inc_lock_ref(node)
        else:
            slots, node = cache.match_prefix(key)
            cached = len(slots)
            cache.lock(node, 1)
        t1 = clock()
        need = len(key) - cached
        if allocator.available() < need:
            freed = cache.evict(need - allocator.available())
            stats.evicted_tokens += freed
        t2 = clock()
        new = allocator.alloc(need)
        if new is None:
            raise RuntimeError("pool too small for one request")
        prefix = match.indices if radix else torch.tensor(slots, dtype=torch.int64)
        t3 = clock()
        done = cache.insert(key, torch.cat([prefix, new]))
        allocator.free(new[: done - cached])
        t4 = clock()
        if radix:
            cache.dec_lock_ref(node)
        else:
            cache.lock(node, -1)
        t5 = clock()
        stats.matches += 1
        stats.match_s += (t1 - t0) + (t5 - t4)
        stats.evict_s += t2 - t1
        stats.inserts += 1
        stats.inserted_tokens += len(key)
        stats.insert_s += t4 - t3
    stats.hit_rate = cache.hit_tokens / max(1, cache.hit_tokens + cache.miss_tokens)
    if radix:
        cache.check_integrity()
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="trace size multiplier (1.0 ≈ 1M tokens)")
    parser.add_argument("--pool", type=int, default=150_000, help="KV pool size in tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trace = build_trace(args.scale, args.seed)
    total = sum(len(k) for k in trace)
    print(f"trace: {len(trace)} requests, {total:,} tokens inserted, pool {args.pool:,} slots")
    rows = [replay("radix", trace, args.pool), replay("naive", trace, args.pool)]
    radix, naive = rows

    def rate(n: float, s: float) -> float:
        return n / s if s > 0 else float("inf")

    print("\n| cache | matches/s | inserts/s | inserted tok/s | evicted tok/s | hit rate |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s in rows:
        print(
            f"| {s.name} | {rate(s.matches, s.match_s):,.0f} | {rate(s.inserts, s.insert_s):,.0f} | "
            f"{rate(s.inserted_tokens, s.insert_s):,.0f} | {rate(s.evicted_tokens, s.evict_s):,.0f} | "
            f"{s.hit_rate:.1%} |"
        )
    print(
        f"\nradix / naive: matches {naive.match_s / radix.match_s:.1f}x, "
        f"inserts {naive.insert_s / radix.insert_s:.1f}x, "
        f"eviction {rate(radix.evicted_tokens, radix.evict_s) / rate(naive.evicted_tokens, naive.evict_s):.1f}x "
        f"(tokens evicted: radix {radix.evicted_tokens:,}, naive {naive.evicted_tokens:,}); "
        f"total {(naive.match_s + naive.insert_s + naive.evict_s) / (radix.match_s + radix.insert_s + radix.evict_s):.1f}x"
    )


if __name__ == "__main__":
    main()
