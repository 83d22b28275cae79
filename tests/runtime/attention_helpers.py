"""Batches of contexts for the CPU attention tests: slots as a paged pool hands them out,
prefixes shared the way the radix cache shares them."""

from __future__ import annotations

import torch
from engine_helpers import contexts_step

from sprig.radix.kv_cache import KVCache, KVShape
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.forward_step import build_forward_batch
from sprig.runtime.model_config import ModelConfig

POOL = 4096


def build_batch(contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr, kv_indices) of the contexts, int32 as the runner builds them."""
    indptr = torch.tensor([0] + [len(c) for c in contexts]).cumsum(0).to(torch.int32)
    return indptr, torch.tensor([s for c in contexts for s in c], dtype=torch.int32)


def fresh(n: int, counter: list[int]) -> list[int]:
    """`n` slots never used before (shuffled, as a paged pool hands them out)."""
    start = counter[0]
    counter[0] += n
    return list(range(start, start + n))[::-1]


def contexts_with_sharing() -> tuple[list[list[int]], dict[int, tuple[list[int], int]]]:
    """A batch mixing shared prefixes (one with a longer shared run inside it; two of
    similar size, attended as one padded bucket), requests that share too little,
    singletons and an empty context; and the expected groups (first member -> members,
    shared length)."""
    c = [100]
    system = fresh(70, c)
    other = fresh(40, c)
    short = fresh(10, c)
    contexts = [
        system + fresh(5, c),  # 0: group A
        fresh(30, c),  # 1: alone
        system + fresh(1, c),  # 2: group A, shortest remainder
        other + fresh(9, c),  # 3: group B
        short + fresh(50, c),  # 4: shares only 10 slots with 5: not grouped
        short + fresh(3, c),  # 5
        system + fresh(64, c),  # 6: group A
        other + fresh(2, c),  # 7: group B
        [],  # 8: no context
    ]
    nested = system + fresh(20, c)
    contexts += [nested + fresh(4, c), nested + fresh(7, c)]  # 9, 10: group A (shares 70 with it)
    third = fresh(36, c)  # group C: padded beside B (more rows than B, fewer shared slots)
    contexts += [third + fresh(n, c) for n in (2, 6, 1)]  # 11, 12, 13
    return contexts, {0: ([0, 2, 6, 9, 10], 70), 3: ([3, 7], 40), 11: ([11, 12, 13], 36)}


def decode_step(contexts: list[list[int]], leave: set[int], counter: list[int]) -> list[int]:
    """Drop the contexts at positions `leave` and give every other one a fresh slot, as a
    decode step after requests finished does; returns the new slots."""
    contexts[:] = [ctx for b, ctx in enumerate(contexts) if b not in leave]
    new = fresh(len(contexts), counter)
    for ctx, slot in zip(contexts, new, strict=True):
        ctx.append(slot)
    return new


def random_pools(config: ModelConfig, layers: int, n: int, storage: torch.dtype | None,
                 device: torch.device) -> list[KVCache]:
    """n equal pools of `layers` layers and POOL slots with random contents (the cached
    prefixes), quantized to `storage`."""
    shape = KVShape(layers, config.num_kv_heads, config.head_dim, torch.float32, storage)
    pools = [KVCache(shape, POOL, device=device) for _ in range(n)]
    g = torch.Generator().manual_seed(1)
    for layer in range(layers):
        for name in ("k", "v") if storage is None else ("k", "v", "k_scale", "v_scale"):
            buf = getattr(pools[0], name)[layer]
            if name in ("k", "v") and storage is not None:
                init = torch.randint(-127, 128, buf.shape, generator=g)
            elif name in ("k", "v"):
                init = torch.randn(buf.shape, generator=g)
            else:
                init = torch.rand(buf.shape, generator=g) / 50
            for pool in pools:
                getattr(pool, name)[layer].copy_(init.to(buf.dtype))
    return pools


def step_batch(mode: ForwardMode, q_lens: list[int], contexts: list[list[int]], pool: KVCache) -> ForwardBatch:
    """The `ForwardBatch` of a step over `contexts` (slot lists) with `q_lens` new tokens each."""
    step = contexts_step(mode, [0] * sum(q_lens), q_lens, [torch.tensor(ctx) for ctx in contexts], [0] * len(q_lens))
    return build_forward_batch(step, pool, pool.device)[0]


def shared_prefix_steps(decode_steps: int) -> list[tuple[ForwardMode, list[int], list[list[int]]]]:
    """(mode, new tokens per request, contexts) of each step: an extend step, then decode
    steps. Three requests share a 40-slot cached prefix (a group in every step), one more
    has 20 slots of its own cached and 4 new (a short extend), one has nothing cached (a
    prefill); the second leaves after the third decode step."""
    c = [1]
    system = fresh(40, c)
    contexts = [system + fresh(6, c), system + fresh(3, c), system + fresh(14, c), fresh(24, c), fresh(30, c)]
    steps = [(ForwardMode.EXTEND, [6, 3, 10, 4, 30], [list(ctx) for ctx in contexts])]
    for step in range(decode_steps):
        if step == 3:
            del contexts[1]
        for ctx in contexts:
            ctx += fresh(1, c)
        steps.append((ForwardMode.DECODE, [1] * len(contexts), [list(ctx) for ctx in contexts]))
    return steps
