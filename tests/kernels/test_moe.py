"""Mixture-of-experts kernels: the routing and the torch reference against a per-token loop
written from the definition; the Triton path against the reference; the padded layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sprig.kernels.moe import align_by_expert, fused_experts, fused_experts_ref, route_topk

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(T: int, E: int, K: int, H: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype)
    weights, ids = route_topk(torch.randn(T, E, generator=g), K, renormalize=True)
    return x, w13, w2, weights, ids


def _by_definition(x, w13, w2, weights, ids) -> torch.Tensor:
    """Each token alone, each of its experts in turn, in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].double() @ w13[e].double().T
            out[t] += float(weights[t, k]) * (F.silu(h[:inter]) * h[inter:]) @ w2[e].double().T
    return out


def test_route_topk_picks_the_most_probable_and_renormalizes() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = route_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(weights, torch.stack([probs[0, [1, 2]], probs[1, [3, 0]]]))
    weights, _ = route_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize(("T", "E", "K"), [(1, 4, 2), (9, 8, 2), (13, 6, 3), (5, 3, 1)])
def test_reference_equals_the_definition(T: int, E: int, K: int) -> None:
    case = _case(T, E, K, H=24, inter=20, dtype=torch.float32)
    got = fused_experts_ref(*case)
    torch.testing.assert_close(got.double(), _by_definition(*case), atol=1e-5, rtol=1e-5)


def test_reference_rows_do_not_depend_on_the_batch() -> None:
    """A token's output is the same alone as beside others that share its experts."""
    x, w13, w2, weights, ids = _case(12, 4, 2, H=32, inter=16, dtype=torch.float32, seed=3)
    together = fused_experts_ref(x, w13, w2, weights, ids)
    for t in (0, 5, 11):
        alone = fused_experts_ref(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1])
        torch.testing.assert_close(alone[0], together[t], atol=1e-6, rtol=1e-6)


def test_align_by_expert_lays_out_every_pair_once_in_its_experts_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    pairs, block_expert = align_by_expert(ids, num_experts=5, block_m=4)
    n = ids.numel()
    assert pairs.numel() == 4 * ((n + 5 * 3 + 3) // 4)
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[4 * b : 4 * b + 4]
        held = block[block < n]
        if e < 0:
            assert held.numel() == 0
        else:
            assert (flat[held] == e).all() and held.tolist() == sorted(held.tolist())
    used = [e for e in block_expert.tolist() if e >= 0]
    assert used == sorted(used) and set(used) == {0, 1, 2, 3}  # expert 4 has no pairs, no block


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "E", "K", "H", "inter"), [(1, 4, 2, 32, 24), (21, 6, 2, 40, 72), (7, 3, 3, 16, 16)])
def test_triton_matches_the_reference(
    T: int, E: int, K: int, H: int, inter: int, dtype: torch.dtype, device: str, force_triton: None, tol: dict
) -> None:
    x, w13, w2, weights, ids = _case(T, E, K, H, inter, dtype, seed=T)
    got = fused_experts(x.to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device))
    expected = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got.cpu(), expected, **tol[dtype])


def test_triton_rows_do_not_depend_on_the_batch(device: str, force_triton: None) -> None:
    x, w13, w2, weights, ids = _case(10, 4, 2, H=32, inter=16, dtype=torch.float32, seed=4)
    args = [t.to(device) for t in (x, w13, w2, weights, ids)]
    together = fused_experts(*args)
    alone = fused_experts(args[0][3:4], args[1], args[2], args[3][3:4], args[4][3:4])
    if device == "cuda":
        assert torch.equal(alone[0].cpu(), together[3].cpu())
    else:  # the interpreter's tl.dot is numpy's matmul, which may round a row by its place in the block
        torch.testing.assert_close(alone[0], together[3], atol=1e-6, rtol=1e-6)
