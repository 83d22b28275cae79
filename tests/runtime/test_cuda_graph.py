"""CUDA-graph decode: the batch sizes, the padding of a step (checked on the CPU against
the eager step metadata), and on a GPU replayed steps against eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_idle_and_intact, contexts_step, make_prompts

from sprig.runtime import Engine
from sprig.runtime.cuda_graph import PAD_SLOT, graph_batch_sizes, pad_decode_step
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep, build_forward_batch
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.runner_config import RunnerConfig


def decode_step(contexts: list[list[int]], tokens: list[int]) -> ForwardStep:
    return contexts_step(
        ForwardMode.DECODE, tokens, [1] * len(tokens),
        [torch.tensor(c) for c in contexts], [0] * len(tokens),
    )


def test_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64)[-3:] == [48, 56, 64]


def test_padding_keeps_the_real_rows_and_parks_the_rest_on_the_padding_slot(tiny_llama: Path) -> None:
    runner = ModelRunner(RunnerConfig(tiny_llama, device="cpu", max_total_tokens=64))
    step = decode_step([[3, 4, 5], [9], [10, 11, 12, 13, 14]], [7, 8, 9])
    eager, _ = build_forward_batch(step, runner.kv_cache, torch.device("cpu"))
    padded = pad_decode_step(step, 8, rows_in_pool=65)
    n = eager.kv_indices.numel()
    assert padded.batch_size == 8
    assert padded.input_ids.tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert torch.equal(padded.positions[:3], eager.positions)
    assert torch.equal(padded.out_cache_loc[:3], eager.out_cache_loc)
    assert torch.equal(padded.kv_indptr[:4], eager.kv_indptr)
    assert torch.equal(padded.kv_indices[:n], eager.kv_indices)
    # each padded row: position 0, a one-slot context on the padding slot, stored there
    assert padded.positions[3:].tolist() == [0] * 5
    assert padded.out_cache_loc[3:].tolist() == [PAD_SLOT] * 5
    assert padded.kv_indptr[4:].tolist() == list(range(n + 1, n + 6))
    assert padded.kv_indices[n:].tolist() == [PAD_SLOT] * 5


def test_padding_rejects_what_a_graph_cannot_run() -> None:
    step = decode_step([[3, 4], [5]], [1, 2])
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_step(step, 1, rows_in_pool=64)
    extend = contexts_step(ForwardMode.EXTEND, [1, 2], [2], [torch.tensor([3, 4])], [1])
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_step(extend, 4, rows_in_pool=64)
    with pytest.raises(ValueError, match="out of range"):
        pad_decode_step(decode_step([[3, 64]], [1]), 2, rows_in_pool=64)


@pytest.mark.gpu
def test_replayed_decode_equals_eager_decode(tiny_llama: Path) -> None:
    config = dict(device="cuda", dtype="float32", max_total_tokens=1024, cuda_graph_max_bs=16)
    graphs = ModelRunner(RunnerConfig(tiny_llama, **config))
    eager = ModelRunner(RunnerConfig(tiny_llama, disable_cuda_graph=True, **config))
    assert graphs.graphs is not None and eager.graphs is None
    gen = torch.Generator().manual_seed(0)
    for B in (1, 3, 8, 13):
        lens = torch.randint(1, 40, (B,), generator=gen).tolist()
        ids = [torch.randint(8, 100, (n,), generator=gen).tolist() for n in lens]
        starts = [1 + 48 * b for b in range(B)]  # room for 3 decode slots each
        ctx = [list(range(s, s + n)) for s, n in zip(starts, lens, strict=True)]
        prefill = contexts_step(
            ForwardMode.EXTEND, [t for p in ids for t in p], lens,
            [torch.tensor(c) for c in ctx], [n - 1 for n in lens],
        )
        for runner in (graphs, eager):
            runner.forward(prefill)
        for _ in range(3):  # three decode steps: each appends one slot per request
            ctx = [[*c, c[-1] + 1] for c in ctx]
            step = decode_step(ctx, [11 + b for b in range(B)])
            torch.testing.assert_close(graphs.forward(step), eager.forward(step), atol=1e-4, rtol=0)
        used = torch.cat([torch.tensor(c) for c in ctx]).cuda()
        for layer in range(len(graphs.kv_cache.k)):
            torch.testing.assert_close(graphs.kv_cache.k[layer][used], eager.kv_cache.k[layer][used])
            torch.testing.assert_close(graphs.kv_cache.v[layer][used], eager.kv_cache.v[layer][used])
    assert graphs.graphs.captured == [1, 4, 8, 16]


@pytest.mark.gpu
def test_engine_output_is_the_same_with_and_without_graphs(tiny_llama: Path) -> None:
    prompts = make_prompts(13, seed=3)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    outs = {}
    for disable in (False, True):
        with Engine(str(tiny_llama), device="cuda", dtype="float32", disable_cuda_graph=disable) as engine:
            outs[disable] = engine.generate(prompts, params, return_logprob=True)
            assert_idle_and_intact(engine)
            assert (engine.runner.graphs is None) == disable
            if not disable:
                assert engine.runner.graphs.captured  # decode really ran in graphs
    for with_graphs, without in zip(outs[False], outs[True], strict=True):
        assert with_graphs["output_ids"] == without["output_ids"]
        got = [lp for lp, _, _ in with_graphs["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in without["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
