"""Decode steps replayed from captured CUDA graphs.

A decode step of a small model on a fast GPU is bound by the host: hundreds of kernel
launches and Python calls per step, each far longer than the GPU work it starts. A
captured graph replays the whole forward pass (embedding, every layer, final norm) with
one launch. Shapes are fixed at capture, so a step of B requests runs in the graph of the
smallest captured batch size >= B, padded with requests that read and write only the KV
pool's padding slot 0. Graphs are captured on first use of each batch size, from static
input buffers the step's inputs are copied into before replay.

Only the model's hidden states are replayed: the caller computes logits from the B real
rows eagerly, and must read a replay's output before the next replay (all graphs share one
memory pool, so one graph's output may overlap another's scratch memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sprig.radix.kv_cache import KVCache
from sprig.runtime.attention.base import AttentionBackend
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode
from sprig.runtime.forward_step import ForwardStep, check_slots

PAD_SLOT = 0  # the KV pool's padding slot: padded requests store and attend there only
MAX_KV_ENTRIES = 1 << 25  # cap of the static slot-table buffer (128 MiB of int32)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then every multiple of 8, up to
    and including `max_bs` (which is always one of them)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    sizes += list(range(8, max_bs, 8))
    return [*sizes, max_bs] if max_bs >= 1 else []


@dataclass(frozen=True)
class PaddedDecode:
    """The inputs of a decode step padded to `batch_size` requests (CPU tensors).

    Rows `B..batch_size-1` are padding: token 0 at position 0, stored in `PAD_SLOT`, with
    a one-slot context `[PAD_SLOT]`. `kv_indices` holds the real contexts then one
    `PAD_SLOT` per padded row.
    """

    batch_size: int
    input_ids: torch.Tensor  # [bs] int64
    positions: torch.Tensor  # [bs] int64
    kv_indptr: torch.Tensor  # [bs+1] int32
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32
    out_cache_loc: torch.Tensor  # [bs] int64


def pad_decode_step(step: ForwardStep, batch_size: int, rows_in_pool: int) -> PaddedDecode:
    """`step` (DECODE mode, B <= batch_size requests) padded to `batch_size` requests.
    Raises ValueError if a slot is outside `[0, rows_in_pool)`."""
    B = len(step.q_lens)
    if step.mode is not ForwardMode.DECODE or batch_size < B:
        raise ValueError(f"cannot pad a {step.mode.value} step of {B} requests to {batch_size}")
    pad = batch_size - B
    kv_lens = torch.tensor(step.kv_lens + [1] * pad, dtype=torch.int64)
    kv_indices = torch.cat([step.kv_indices.to(torch.int32), torch.full((pad,), PAD_SLOT, dtype=torch.int32)])
    check_slots(kv_indices, rows_in_pool)
    kv_indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    kv_indptr[1:] = kv_lens.cumsum(0)
    return PaddedDecode(
        batch_size=batch_size,
        input_ids=torch.tensor(step.input_ids + [0] * pad, dtype=torch.int64),
        positions=kv_lens - 1,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        out_cache_loc=kv_indices[kv_indptr[1:].long() - 1].to(torch.int64),
    )


class DecodeGraphs:
    """Captured decode forward passes of one model, one graph per batch size in
    `graph_batch_sizes(max_bs)`, captured lazily.

    Invariant: the static buffers live as long as this object and every graph reads its
    inputs from them; `run` refills them before each replay. Not thread-safe.
    """

    def __init__(
        self, model: nn.Module, backend: AttentionBackend, kv_cache: KVCache, *,
        max_bs: int, context_len: int, device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.context_len = context_len
        self.sizes = graph_batch_sizes(max_bs)
        self.max_kv_entries = min(max_bs * context_len, MAX_KV_ENTRIES)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self._input_ids = torch.zeros(max_bs, **i64)
        self._positions = torch.zeros(max_bs, **i64)
        self._out_cache_loc = torch.full((max_bs,), PAD_SLOT, **i64)
        self._qo_indptr = torch.arange(max_bs + 1, **i32)
        self._kv_indptr = torch.arange(max_bs + 1, **i32)
        self._kv_indices = torch.full((self.max_kv_entries,), PAD_SLOT, **i32)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def captured(self) -> list[int]:
        """Batch sizes whose graphs exist so far."""
        return sorted(self._graphs)

    def bucket(self, step: ForwardStep) -> int | None:
        """The batch size whose graph runs `step`, or None when it must run eagerly."""
        B = len(step.q_lens)
        if step.mode is not ForwardMode.DECODE or self.sizes[-1] < B:
            return None
        bs = next(s for s in self.sizes if s >= B)
        entries = step.kv_indices.numel() + bs - B
        return bs if entries <= self.max_kv_entries else None

    def run(self, step: ForwardStep, bs: int) -> torch.Tensor:  # [B, H]
        """Hidden states of `step`'s B requests, replayed from the graph of size `bs`
        (captured now if it is the first use). Stores the new tokens' K/V like an eager
        forward pass."""
        rows_in_pool = self.kv_cache.num_slots + self.kv_cache.page_size
        padded = pad_decode_step(step, bs, rows_in_pool)
        if bs not in self._graphs:
            self._graphs[bs] = self._capture(bs)
        graph, hidden = self._graphs[bs]
        n = padded.kv_indices.numel()
        self._input_ids[:bs].copy_(padded.input_ids, non_blocking=True)
        self._positions[:bs].copy_(padded.positions, non_blocking=True)
        self._out_cache_loc[:bs].copy_(padded.out_cache_loc, non_blocking=True)
        self._kv_indptr[: bs + 1].copy_(padded.kv_indptr, non_blocking=True)
        self._kv_indices[:n].copy_(padded.kv_indices, non_blocking=True)
        graph.replay()
        return hidden[: len(step.q_lens)]

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self._input_ids[:bs],
            positions=self._positions[:bs],
            qo_indptr=self._qo_indptr[: bs + 1],
            kv_indptr=self._kv_indptr[: bs + 1],
            kv_indices=self._kv_indices,
            out_cache_loc=self._out_cache_loc[:bs],
            kv_cache=self.kv_cache,
            max_q_len=1,
            max_kv_len=self.context_len,
        )

    def _capture(self, bs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward pass of `bs` padding requests (every row reads and writes
        `PAD_SLOT`), after two eager runs that compile and load every kernel."""
        self._input_ids[:bs].zero_()
        self._positions[:bs].zero_()
        self._out_cache_loc[:bs].fill_(PAD_SLOT)
        self._kv_indptr[: bs + 1].copy_(self._qo_indptr[: bs + 1])
        self._kv_indices[:bs].fill_(PAD_SLOT)
        batch = self._batch(bs)
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(2):
                self.backend.begin_step(batch)
                self.model(batch, self.backend)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.backend.begin_step(batch)
            hidden = self.model(batch, self.backend)  # [bs, H]
        return graph, hidden
