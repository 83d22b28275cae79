"""The batched sampler: each test fails if the parameter it covers were ignored."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sprig.runtime.sampling import (
    SamplingBatch,
    SamplingParams,
    process_logits,
    sample,
    token_logprobs,
)
from sprig.runtime.sampling.noise import exponential_noise, fmix64, row_key, token_bits

# p = [0.5, 0.3, 0.1, 0.05, 0.05]: nucleus(0.75) = {0, 1}, min_p(0.15) keeps {0, 1, 2}
SKEWED = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]).log()


def build(params, logits, *, output_ids=None, prompt_ids=None, eos_ids=()) -> SamplingBatch:
    return SamplingBatch.build(
        params,
        output_ids=output_ids if output_ids is not None else [[] for _ in params],
        prompt_ids=prompt_ids,
        eos_ids=eos_ids,
        vocab_size=logits.shape[1],
    )


def run(params, logits, *, generator_seed: int = 0, top_logprobs_num=0, **kw):
    generator = torch.Generator().manual_seed(generator_seed)
    batch = build(params, logits, **kw)
    return sample(logits, batch, generator=generator, top_logprobs_num=top_logprobs_num)


def frequencies(row: torch.Tensor, n: int = 4000, *, seeded: bool = False, **kw) -> torch.Tensor:
    """Empirical distribution of n draws of one logits row (rows seeded 0..n-1 if asked)."""
    base = SamplingParams(**kw)
    params = [dataclasses.replace(base, seed=i) for i in range(n)] if seeded else [base] * n
    ids = run(params, row.expand(n, -1).clone()).next_ids
    return torch.bincount(ids, minlength=row.numel()).float() / n


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    greedy = [SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=5)]
    params = greedy * 2 + [SamplingParams(), SamplingParams(seed=3, top_p=0.5)]
    out = run(params, logits)
    assert torch.equal(out.next_ids[:4], logits[:4].argmax(dim=-1))
    all_greedy = build(greedy * 3, logits)
    assert all_greedy.draws is None and all_greedy.penalties is None
    assert all_greedy.logit_bias is None and all_greedy.banned is None
    assert process_logits(logits, all_greedy) is logits
    assert torch.equal(sample(logits, all_greedy).next_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_draws_follow_softmax_at_temperature(seeded: bool, temperature: float) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    freq = frequencies(row, seeded=seeded, temperature=temperature)
    assert torch.allclose(freq, (row / temperature).softmax(-1), atol=0.03)


def test_temperature_concentrates_and_spreads() -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])  # p(top) = 0.56 at temperature 1
    assert frequencies(row, temperature=0.2)[0] > 0.9
    assert frequencies(row, temperature=5.0)[0] < 0.35


def test_top_k_keeps_only_the_k_most_likely() -> None:
    row = torch.randn(50, generator=torch.Generator().manual_seed(2))
    allowed = set(row.topk(5).indices.tolist())
    drawn = set(frequencies(row, n=3000, temperature=3.0, top_k=5).nonzero().flatten().tolist())
    assert drawn == allowed
    unfiltered = frequencies(row, n=3000, temperature=3.0).nonzero().flatten().tolist()
    assert not set(unfiltered) <= allowed


def test_top_p_never_leaves_the_nucleus() -> None:
    freq = frequencies(SKEWED, top_p=0.75)
    assert freq[2:].sum() == 0
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.03
    assert frequencies(SKEWED, top_p=1.0)[2:].sum() > 0.1


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    """top_p below float32's smallest value rounds to 0 there: the top token still stays
    (it used to leave nothing, and the argmax of all -inf picked token 0)."""
    row = SKEWED.roll(2)  # the most likely token is 2, not 0
    assert frequencies(row, top_p=top_p).tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    # top-3 renormalized: [0.556, 0.333, 0.111]; mass before token 2 is 0.889 > 0.85
    freq = frequencies(SKEWED, top_k=3, top_p=0.85)
    assert freq[2:].sum() == 0 and freq[1] > 0.3


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    freq = frequencies(SKEWED, min_p=0.15)  # threshold 0.075
    assert set(freq.nonzero().flatten().tolist()) == {0, 1, 2}
    assert abs(freq[2].item() - 0.1 / 0.9) < 0.02


RAW = torch.tensor([1.0, 0.9, 0.5, -0.5, 0.2, -1.0])


def test_penalties_adjust_exactly_and_flip_the_choice() -> None:
    params = [
        SamplingParams(temperature=0, frequency_penalty=0.1),
        SamplingParams(temperature=0, presence_penalty=0.5),
        SamplingParams(temperature=0, frequency_penalty=0.1, presence_penalty=0.5),
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0),
    ]
    logits = RAW.expand(5, -1).clone()
    kw = {"output_ids": [[0, 0, 3, 5]] * 3 + [[5], [0, 0]], "prompt_ids": [[1]] * 3 + [[0, 3], [0]]}
    expected = RAW.expand(5, -1).clone()
    expected[0, [0, 3, 5]] = torch.tensor([1.0 - 0.2, -0.5 - 0.1, -1.0 - 0.1])
    expected[1, [0, 3, 5]] = torch.tensor([1.0 - 0.5, -0.5 - 0.5, -1.0 - 0.5])
    expected[2, [0, 3, 5]] = torch.tensor([1.0 - 0.7, -0.5 - 0.6, -1.0 - 0.6])
    expected[3, [0, 3, 5]] = torch.tensor([1.0 / 2, -0.5 * 2, -1.0 * 2])
    processed = process_logits(logits, build(params, logits, **kw))
    assert torch.allclose(processed, expected, atol=1e-6)
    assert torch.equal(logits, RAW.expand(5, -1)), "the input logits must not change"
    assert run(params, logits, **kw).next_ids.tolist() == [1, 1, 1, 1, 0]


def test_repetition_penalty_needs_prompt_ids() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        build([SamplingParams(repetition_penalty=1.2)], RAW[None])


def test_logit_bias_forces_and_removes_tokens() -> None:
    params = [
        SamplingParams(temperature=0, logit_bias={5: 100}),
        SamplingParams(temperature=0, logit_bias={"0": -100}),
    ]
    logits = RAW.expand(2, -1).clone()
    processed = process_logits(logits, build(params, logits))
    assert processed[0, 5] == 99.0 and processed[1, 0] == -99.0
    assert run(params, logits).next_ids.tolist() == [5, 1]
    uniform = torch.zeros(8)
    assert frequencies(uniform, n=2000, logit_bias={3: -100})[3] == 0
    assert frequencies(uniform, n=2000, logit_bias={6: 100})[6] == 1
    with pytest.raises(ValueError, match="vocabulary"):
        build([SamplingParams(logit_bias={8: 1.0})], uniform[None])


def test_min_new_tokens_bans_stop_tokens_until_reached() -> None:
    row = torch.zeros(8)
    row[2], row[4] = 50.0, 60.0  # EOS 2 and stop token 4 dominate
    kinds = [{"temperature": 0}, {"seed": 1}, {"temperature": 2.0}]
    params = [
        SamplingParams(min_new_tokens=3, stop_token_ids=(4,), **kw)
        for kw in kinds
        for _ in range(200)
    ]
    logits = row.expand(len(params), -1).clone()
    for step in range(3):
        ids = run(params, logits, output_ids=[[7] * step] * len(params), eos_ids=[2]).next_ids
        assert not ({2, 4} & set(ids.tolist()))
    ids = run(params, logits, output_ids=[[7] * 3] * len(params), eos_ids=[2]).next_ids
    assert set(ids.tolist()) <= {2, 4} and ids[0] == 4
    ignore = [SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=(4,), ignore_eos=True)]
    assert run(ignore, row[None], output_ids=[[]], eos_ids=[2]).next_ids.item() == 2


def test_seeded_rows_ignore_batch_composition_and_position() -> None:
    vocab = 1000
    mine = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.5
    request = SamplingParams(seed=42, top_p=0.95)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(seed=7, top_k=3, min_p=0.1),
        SamplingParams(frequency_penalty=1.0),
        SamplingParams(logit_bias={1: 5.0}, repetition_penalty=1.5),
    ]
    crowd = torch.randn(len(others) + 1, vocab)
    alone, crowded, other_seed = [], [], []
    for step in range(12):
        output = [list(range(step))]
        alone.append(run([request], mine[None], output_ids=output).next_ids.item())
        logits = crowd.clone()
        logits[3] = mine
        params = [*others[:3], request, others[3]]
        batch_out = run(
            params, logits, output_ids=output * 5, prompt_ids=[[2]] * 5, generator_seed=step + 100
        ).next_ids
        crowded.append(batch_out[3].item())
        other = SamplingParams(seed=43, top_p=0.95)
        other_seed.append(run([other], mine[None], output_ids=output).next_ids.item())
    assert alone == crowded
    assert len(set(alone)) > 6, "the step must change the draw"
    assert sum(a != b for a, b in zip(alone, other_seed, strict=True)) > 6


def test_unseeded_rows_follow_the_generator() -> None:
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    first = run(params, logits, generator_seed=9).next_ids
    assert torch.equal(first, run(params, logits, generator_seed=9).next_ids)
    assert not torch.equal(first, run(params, logits, generator_seed=10).next_ids)


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0, logit_bias={7: 30}),
        SamplingParams(temperature=0.5, top_k=4),
        SamplingParams(seed=1, frequency_penalty=2, min_new_tokens=5, stop_token_ids=(3,)),
        SamplingParams(temperature=0),
    ]
    nums = [0, 3, 5, 1]
    out = run(params, logits, output_ids=[[1, 2]] * 4, top_logprobs_num=nums)
    raw = logits.log_softmax(dim=-1)
    assert out.next_ids[0] == 7
    assert torch.allclose(out.logprobs, raw.gather(1, out.next_ids[:, None])[:, 0], atol=1e-5)
    top = out.top_logprobs
    assert top is not None and top.values.shape == (4, 5)
    assert torch.all(top.values[:, :-1] >= top.values[:, 1:])
    expected = raw.topk(5, dim=-1)
    assert torch.allclose(top.values, expected.values, atol=1e-5)
    assert torch.equal(top.ids, expected.indices)
    assert run(params, logits, output_ids=[[1, 2]] * 4).top_logprobs is None
    batch = SamplingBatch.build(params, output_ids=[[1, 2]] * 4, vocab_size=50)
    bare = sample(logits, batch, logprobs=False, generator=torch.Generator().manual_seed(0))
    assert bare.logprobs is None and bare.top_logprobs is None  # nobody asked: no log-softmax
    assert torch.equal(bare.next_ids, run(params, logits, output_ids=[[1, 2]] * 4).next_ids)
    assert sample(logits, batch, top_logprobs_num=2, logprobs=False).logprobs is not None


def test_input_token_logprobs_helper() -> None:
    logits = torch.randn(7, 11, generator=torch.Generator().manual_seed(4))
    next_tokens = torch.tensor([3, 0, 10, 5, 5, 1, 2])
    lp, top = token_logprobs(logits, next_tokens, top_k=20)
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(lp, raw[torch.arange(7), next_tokens], atol=1e-6)
    assert top is not None and top.ids.shape == (7, 11)
    assert torch.allclose(top.values, raw.sort(dim=-1, descending=True).values, atol=1e-6)
    assert token_logprobs(logits, next_tokens)[1] is None


def test_noise_hash_matches_the_python_reference() -> None:
    keys = [row_key(s, t) for s, t in [(0, 0), (42, 3), (-5, 10**6), (2**64 - 1, 7)]]
    bits = token_bits(torch.tensor(keys), 6)
    for i, key in enumerate(keys):
        for v in range(6):
            want = fmix64((key + (v + 1) * 0x9E3779B97F4A7C15) % 2**64)
            assert bits[i, v].item() % 2**64 == want
    noise = exponential_noise(torch.tensor(keys), 50_000)
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert abs(noise.mean().item() - 1.0) < 0.01


@pytest.mark.gpu
def test_seeded_draws_agree_between_cpu_and_cuda() -> None:
    keys = torch.tensor([row_key(s, t) for s in range(8) for t in range(4)])
    assert torch.equal(token_bits(keys, 4096), token_bits(keys.cuda(), 4096).cpu())
    logits = torch.randn(32, 4096, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(seed=s, top_p=0.9) for s in range(32)]
    on_cpu = run(params, logits).next_ids
    batch = SamplingBatch.build(params, output_ids=[[]] * 32, vocab_size=4096, device="cuda")
    on_gpu = sample(logits.cuda(), batch, generator=torch.Generator("cuda")).next_ids.cpu()
    assert (on_cpu == on_gpu).float().mean() > 0.9  # last-ulp float differences may flip a tie


def reference_support(row: torch.Tensor, p: SamplingParams, slack: float) -> set[int]:
    """Tokens a row may draw, by a plain per-token reading of the filters; `slack` widens
    top_p and narrows min_p to absorb float32 rounding at the boundaries."""
    probs = (row.double() / p.temperature).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    if p.top_k > 0:
        order = order[: p.top_k]
    mass = sum(probs[v] for v in order)
    keep, before = set(), 0.0
    for v in order:
        q = probs[v] / mass
        if (before < p.top_p + slack or p.top_p >= 1) and q >= p.min_p * probs[
            order[0]
        ] / mass - slack:
            keep.add(v)
        before += q
    return keep


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    temperature=st.floats(0.2, 3.0),
    top_k=st.sampled_from([-1, 1, 2, 5, 19]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_draws_stay_in_the_filtered_support(
    seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.randn(20, generator=torch.Generator().manual_seed(seed % 1000)) * 2
    p = SamplingParams(seed=seed, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ids = run([p] * 64, row.expand(64, -1).clone(), output_ids=[[0] * i for i in range(64)])
    assert set(ids.next_ids.tolist()) <= reference_support(row, p, slack=1e-4)
    assert math.isfinite(ids.logprobs.sum().item())
