"""Acceptance rules of speculative decoding: which drafted tokens the target keeps.

Two rules, both lossless (each emitted token is distributed exactly as the target's
sampler would draw it, given the tokens before it):

- Deterministic drafters (a one-hot draft distribution q at the drafted token x): the
  coupling `accepted_length`. At every drafted position the target token y is drawn from
  p with exactly the draw the non-speculative sampler makes there (a seeded request's
  noise depends only on its seed and position); x is accepted iff y == x, else y is
  emitted and the rest dropped. Accepting with probability p(x) and, on rejection,
  emitting y ~ p conditioned on y != x is rejection sampling with one-hot q
  (normalize(max(0, p - q)) is that conditional), so it is lossless, and a seeded
  request emits the same tokens with speculation on or off.
- Stochastic drafters (a draft model's q): `speculative_step` accepts x with probability
  min(1, p(x) / q(x)) and on rejection draws from normalize(max(0, p - q)).

p is always the distribution the sampler draws from without speculation: after
logit_bias, penalties, temperature, top-k/top-p/min-p and the grammar mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted_length(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the coupling keeps: the longest prefix with `drafts[j] == targets[j]`.

    `targets[j]` is the target's token after the context extended by `drafts[:j]`, so
    `len(targets) == len(drafts) + 1`; the tokens emitted are `targets[: a + 1]` for the
    returned a (the kept drafts, then the target's own token at the first mismatch, or
    the bonus token after the last draft).
    """
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"{len(targets)} target tokens for {len(drafts)} drafts; need one more")
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """min(1, p(x) / q(x)) for a draft x drawn from q (so q(x) > 0); p, q: [V] probabilities."""
    qx = float(q[x])
    if qx <= 0:
        raise ValueError(f"draft token {x} has probability 0 under the draft distribution")
    return min(1.0, float(p[x]) / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # [V]
    """normalize(max(0, p - q)): what a rejection draws from. Where p == q everywhere
    (nothing is ever rejected) it is p itself."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return p.clone() if float(total) <= 0 else r / total


def speculative_step(
    p: torch.Tensor,  # [V] target probabilities
    q: torch.Tensor,  # [V] draft probabilities, q[x] > 0
    x: int,
    *,
    uniform: float,  # in [0, 1): the acceptance draw
    noise: torch.Tensor,  # [V] Exp(1) variates: the rejection draw
) -> tuple[bool, int]:
    """One position of rejection sampling: (accepted, emitted token). Accepted: the token
    is x. Rejected: the exponential race `argmax(r / E)` over the residual r, which picks
    v with probability r(v)."""
    if uniform < accept_probability(p, q, x):
        return True, x
    return False, int((residual(p, q) / noise).argmax())
