"""The slot allocator, the request-to-token table and the KV buffers."""

from __future__ import annotations

import pytest
import torch

from sprig.radix import (
    AllocatorError,
    KVCache,
    KVShape,
    ReqToTokenPool,
    SlotAllocator,
    slots_for_budget,
)


def test_alloc_is_all_or_nothing_and_skips_padding() -> None:
    alloc = SlotAllocator(8)
    got = alloc.alloc(5)
    assert sorted(got.tolist()) == [1, 2, 3, 4, 5]
    assert alloc.alloc(4) is None  # more than is free: nothing, not 3
    assert alloc.available() == 3
    alloc.free(got)
    assert alloc.available() == 8
    assert 0 not in alloc.alloc(8).tolist()
    assert alloc.alloc(0).numel() == 0


def test_pages_are_whole_and_page_zero_is_reserved() -> None:
    alloc = SlotAllocator(16, page_size=4, check=True)
    got = alloc.alloc(8)
    assert got.view(2, 4).diff(dim=1).eq(1).all() and (got.view(2, 4)[:, 0] % 4 == 0).all()
    assert got.min() >= 4
    with pytest.raises(ValueError, match="multiple of 4"):
        alloc.alloc(3)
    alloc.free(got[[0, 5]])  # any slot of a page frees the whole page
    assert alloc.available() == 16


def test_check_mode_catches_double_free_and_foreign_indices() -> None:
    alloc = SlotAllocator(8, check=True)
    got = alloc.alloc(2)
    alloc.free(got)
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free(got)
    for bad in ([0], [9], [-1]):
        with pytest.raises(AllocatorError, match="foreign"):
            alloc.free(torch.tensor(bad))
    with pytest.raises(AllocatorError, match="twice"):
        alloc.free(torch.tensor([3, 3]))
    assert alloc.available() == 8


def test_freed_slots_are_reused() -> None:
    alloc = SlotAllocator(4, check=True)
    a = alloc.alloc(4)
    alloc.free(a[:2])
    b = alloc.alloc(2)
    assert sorted(b.tolist()) == sorted(a[:2].tolist())


def test_req_to_token_rows() -> None:
    pool = ReqToTokenPool(2, 8)
    assert pool.table.dtype == torch.int32 and pool.table.shape == (2, 8)
    r0, r1 = pool.alloc(), pool.alloc()
    assert {r0, r1} == {0, 1} and pool.alloc() is None
    pool.write(r1, 2, torch.tensor([7, 8, 9]))
    assert pool.read(r1, 5, start=2).tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write(r1, 6, torch.tensor([1, 2, 3]))
    pool.write_at(torch.tensor([r0, r1, r1]), torch.tensor([0, 5, 6]), torch.tensor([4, 5, 6]))
    assert pool.read(r0, 1).tolist() == [4] and pool.read(r1, 7, start=2).tolist() == [7, 8, 9, 5, 6]
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write_at(torch.tensor([r0]), torch.tensor([8]), torch.tensor([1]))
    pool.free(r0)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(r0)
    assert pool.alloc() == r0


def test_kv_buffers_and_sizing() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert shape.bytes_per_token == 2 * 2 * 2 * 8 * 2
    n = slots_for_budget(shape.bytes_per_token * 100, shape, page_size=16)
    assert n == 80  # 100 rows, 16 for the padding page, rounded down to whole pages
    cache = KVCache(shape, n, page_size=16)
    assert cache.k[1].shape == (96, 2, 8) and cache.v[0].dtype == torch.float16
    assert cache.nbytes() <= shape.bytes_per_token * 100
    loc = torch.tensor([16, 20])
    cache.store(1, loc, torch.ones(2, 2, 8), torch.full((2, 2, 8), 2.0))
    assert cache.k[1][20].eq(1).all() and cache.v[1][16].eq(2).all() and cache.k[0].eq(0).all()
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVShape(num_layers=1, num_kv_heads=0, head_dim=8, dtype=torch.float32)


def test_req_to_token_reads_many_rows_in_one_gather() -> None:
    pool = ReqToTokenPool(4, 6)
    rows = [pool.alloc() for _ in range(4)]
    for r in rows:
        pool.write(r, 0, torch.arange(6) + 10 * r)
    ends = [3, 6, 1, 0]
    got = pool.read_many([rows[2], rows[0], rows[3], rows[1]], ends)
    want = torch.cat([pool.read(r, n) for r, n in zip([rows[2], rows[0], rows[3], rows[1]], ends, strict=True)])
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()
    assert pool.read_many([], []).numel() == 0
    with pytest.raises(ValueError, match="max_context_len"):
        pool.read_many([rows[0]], [7])
