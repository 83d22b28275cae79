"""Normalizing a `/generate`-style call (single or batch, `n` samples each) into one
entry per sequence to generate; shared by the offline engine and the server."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sprig.runtime.sampling import SamplingParams

SamplingArg = dict[str, Any] | SamplingParams | Sequence[dict[str, Any] | SamplingParams] | None


@dataclass(frozen=True)
class SeqSpec:
    """One sequence to generate."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams


def ids_batch(input_ids: Any) -> tuple[bool, list[list[int]]]:
    """`input_ids` as (is_batch, rows); `ValueError` unless a non-empty list of ints or of
    lists of ints (an empty row is left for the caller to reject)."""
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of ints or of lists of ints")
    batch = isinstance(input_ids[0], list)
    rows = input_ids if batch else [input_ids]
    for row in rows:
        if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise ValueError("input_ids must be a list of ints or a list of lists of ints")
    return batch, [list(r) for r in rows]


def params_per_prompt(arg: SamplingArg, n: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: a list must have one entry per prompt; a single
    dict applies to all. `ValueError` names the bad parameter."""

    def one(p: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        return p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)

    if isinstance(arg, list | tuple):
        if len(arg) != n:
            raise ValueError(f"sampling_params has {len(arg)} entries for {n} prompts")
        return [one(p) for p in arg]
    return [one(arg)] * n


def rids_per_prompt(rid: str | list[str] | None, n: int, new_rid: Callable[[], str]) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(n)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != n or not all(isinstance(r, str) and r for r in rids):
        raise ValueError(f"rid must be a non-empty string or a list of {n} non-empty strings")
    return rids


def expand(rids: list[str], prompts: list[list[int]], params: list[SamplingParams]) -> list[SeqSpec]:
    """Every sequence of the call in output order: prompt by prompt, `n` samples each.
    With n > 1 sample j has rid `f"{rid}-{j}"` and seed `seed + j` (when seeded)."""
    return [
        SeqSpec(
            rid=f"{rid}-{j}" if p.n > 1 else rid,
            prompt_ids=ids,
            params=replace(p, seed=None if p.seed is None else p.seed + j),
        )
        for rid, ids, p in zip(rids, prompts, params, strict=True)
        for j in range(p.n)
    ]
