"""One step's sampling parameters as tensors, built from plain Python data by the scheduler.

Only what the batch uses is built: an all-greedy batch with no bias, penalty or
min-new-tokens constraint holds no tensors at all, and the `[P, V]` penalty tensors
cover only the P rows that use a penalty.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from sprig.runtime.sampling.noise import row_key
from sprig.runtime.sampling.params import SamplingParams


@dataclass(frozen=True)
class SparseLogits:
    """Values added to single logits: `logits[rows[i], token_ids[i]] += values[i]`.

    No (row, token) pair repeats. A value of -inf bans the token.
    """

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass(frozen=True)
class Penalties:
    """Penalties of the P rows that use one. `output_counts` is None when no row uses a
    frequency or presence penalty; `seen` is None when no row uses a repetition penalty.
    """

    rows: torch.Tensor  # [P] int64, batch rows
    frequency: torch.Tensor  # [P, 1] float32, OpenAI: subtract frequency * count
    presence: torch.Tensor  # [P, 1] float32, OpenAI: subtract presence * (count > 0)
    repetition: torch.Tensor  # [P, 1] float32, HF: divide logits > 0, multiply others
    output_counts: torch.Tensor | None  # [P, V] float32, occurrences in the row's output
    seen: torch.Tensor | None  # [P, V] bool, token occurs in the row's prompt or output


@dataclass(frozen=True)
class Draws:
    """The S rows that sample (the others take the argmax). Unseeded rows come first, then
    the K seeded ones, whose noise derives from `seed_keys` alone. `top_ks` is V where
    top-k is off; the `use_*` flags say whether any row filters that way."""

    rows: torch.Tensor  # [S] int64, batch rows
    temperatures: torch.Tensor  # [S, 1] float32, > 0
    top_ks: torch.Tensor  # [S, 1] int64, in [1, V]
    top_ps: torch.Tensor  # [S, 1] float32, in (0, 1]
    min_ps: torch.Tensor  # [S, 1] float32, in [0, 1]
    seed_keys: torch.Tensor  # [K] int64, row_key(seed, step) of the last K rows
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool


@dataclass(frozen=True)
class SamplingBatch:
    """Everything `sample` needs about a step's B requests beyond the logits."""

    batch_size: int
    vocab_size: int
    logit_bias: SparseLogits | None
    banned: SparseLogits | None  # stop tokens (value -inf) of rows below min_new_tokens
    penalties: Penalties | None
    draws: Draws | None  # None: every row is greedy

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        eos_ids: Iterable[int] = (),
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Row b is the request with `params[b]` that has generated `output_ids[b]` so far.

        `prompt_ids` is needed only if some row has a repetition penalty. A seeded row's
        randomness depends only on its seed and `len(output_ids[b])`.
        """
        if len(output_ids) != len(params) or (
            prompt_ids is not None and len(prompt_ids) != len(params)
        ):
            raise ValueError("params, output_ids and prompt_ids must have one entry per row")
        eos = tuple(eos_ids)
        bias = [(b, t, v) for b, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
        banned = [
            (b, t, float("-inf"))
            for b, p in enumerate(params)
            if len(output_ids[b]) < p.min_new_tokens
            for t in sorted(p.stop_token_set(eos))
        ]
        return cls(
            batch_size=len(params),
            vocab_size=vocab_size,
            logit_bias=_sparse(bias, vocab_size, device),
            banned=_sparse(banned, vocab_size, device),
            penalties=_penalties(params, output_ids, prompt_ids, vocab_size, device),
            draws=_draws(params, output_ids, vocab_size, device),
        )


def _sparse(
    entries: list[tuple[int, int, float]], vocab_size: int, device: torch.device | str
) -> SparseLogits | None:
    if not entries:
        return None
    rows, ids, values = zip(*entries, strict=True)
    if max(ids) >= vocab_size:
        raise ValueError(f"token id {max(ids)} is outside the vocabulary [0, {vocab_size})")
    return SparseLogits(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        values=torch.tensor(values, dtype=torch.float32, device=device),
    )


def _occurrences(
    seqs: list[Sequence[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors of every token of every sequence."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(seqs)), lengths).to(device)
    ids = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    return rows, ids.to(device)


def _penalties(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]] | None,
    vocab_size: int,
    device: torch.device | str,
) -> Penalties | None:
    rows = [
        b
        for b, p in enumerate(params)
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1
    ]
    if not rows:
        return None

    def column(name: str) -> torch.Tensor:
        values = [getattr(params[b], name) for b in rows]
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    counts = seen = None
    shape = (len(rows), vocab_size)
    if any(params[b].frequency_penalty or params[b].presence_penalty for b in rows):
        index = _occurrences([output_ids[b] for b in rows], device)
        ones = torch.ones(index[0].numel(), dtype=torch.float32, device=device)
        counts = torch.zeros(shape, device=device).index_put_(index, ones, accumulate=True)
    if any(params[b].repetition_penalty != 1 for b in rows):
        if prompt_ids is None:
            raise ValueError("prompt_ids are required when a row has a repetition_penalty")
        context = [[*prompt_ids[b], *output_ids[b]] for b in rows]
        index = _occurrences(context, device)
        seen = torch.zeros(shape, dtype=torch.bool, device=device)
        seen[index] = True
    return Penalties(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        frequency=column("frequency_penalty"),
        presence=column("presence_penalty"),
        repetition=column("repetition_penalty"),
        output_counts=counts,
        seen=seen,
    )


def _draws(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> Draws | None:
    unseeded = [b for b, p in enumerate(params) if not p.is_greedy and p.seed is None]
    seeded = [(b, p.seed) for b, p in enumerate(params) if not p.is_greedy and p.seed is not None]
    rows = unseeded + [b for b, _ in seeded]
    if not rows:
        return None
    chosen = [params[b] for b in rows]
    top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in chosen]
    keys = [row_key(seed, len(output_ids[b])) for b, seed in seeded]

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    return Draws(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        temperatures=column([p.temperature for p in chosen]),
        top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device)[:, None],
        top_ps=column([p.top_p for p in chosen]),
        min_ps=column([p.min_p for p in chosen]),
        seed_keys=torch.tensor(keys, dtype=torch.int64, device=device),
        use_top_k=min(top_ks) < vocab_size,
        use_top_p=any(p.top_p < 1 for p in chosen),
        use_min_p=any(p.min_p > 0 for p in chosen),
    )
