"""Tree nodes and key handling for the radix cache.

Keys are numpy int32 arrays so that comparing two keys runs at C speed; values are
int64 torch tensors of KV slot indices, one per key token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
# Namespaces keep K/V computed under different weights apart (LoRA adapters): namespace n > 0
# keys token t as t + (n << NAMESPACE_SHIFT); namespace 0 keys tokens as they are. Token ids
# stay below 1 << NAMESPACE_SHIFT, and namespaces below 1 << (31 - NAMESPACE_SHIFT).
NAMESPACE_SHIFT = 24
TOKEN_MASK = (1 << NAMESPACE_SHIFT) - 1
MAX_NAMESPACES = 1 << (31 - NAMESPACE_SHIFT)


def namespaced(token_ids: list[int], namespace: int) -> list[int]:
    """`token_ids` as namespace `namespace` keys them (see `NAMESPACE_SHIFT`)."""
    if not namespace:
        return token_ids
    offset = namespace << NAMESPACE_SHIFT
    return [t + offset for t in token_ids]


def namespace_of(key: np.ndarray) -> int:
    """The namespace a non-empty key belongs to."""
    return int(key[0]) >> NAMESPACE_SHIFT


def as_key(token_ids: TokenIds) -> np.ndarray:
    """A contiguous int32 numpy array view or copy of `token_ids`."""
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().to("cpu", torch.int32).numpy()
    return np.ascontiguousarray(token_ids, dtype=np.int32)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays (vectorised)."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class TreeNode:
    """A node owns `key` (token ids) and `value` (their slots), both of equal length.

    `lock_ref > 0` means some request uses this node's KV: it and its ancestors are
    protected from eviction.
    """

    __slots__ = ("children", "hit_count", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, key: np.ndarray, value: torch.Tensor, parent: TreeNode | None, clock: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int | bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = clock
        self.hit_count = 0

    def __len__(self) -> int:
        return self.key.shape[0]

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:  # heap ties
        return id(self) < id(other)

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self)}, lock_ref={self.lock_ref}, children={len(self.children)})"
