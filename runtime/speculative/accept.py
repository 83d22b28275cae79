"""Acceptance rules of speculative decoding: which drafted tokens the target keeps.

Two rules, both lossless (each emitted token is distributed exactly as the target's
sampler would draw it, given the tokens before it):

- Deterministic drafters (a one-hot draft distribution q at the drafted token x): the
  coupling `tree_walk`. At every drafted position the target token y is drawn from p
  with exactly the draw the non-speculative sampler makes there (a seeded request's
  noise depends only on its seed and position); x is accepted iff y == x, else y is
  emitted and the rest dropped. Accepting with probability p(x) and, on rejection,
  emitting y ~ p conditioned on y != x is rejection sampling with one-hot q
  (normalize(max(0, p - q)) is that conditional), so it is lossless, and a seeded
  request emits the same tokens with speculation on or off. Over a token tree (the
  draft and alternative paths) the coupling stays the same: at each depth the target's
  token is read from one row holding the context of the tokens kept so far, a row chosen
  by those tokens alone, and the walk goes on along a path that has it; so every
  emitted token is the draw the sampler makes there.
- Stochastic drafters (a draft model's q): `speculative_step` accepts x with probability
  min(1, p(x) / q(x)) and on rejection draws from normalize(max(0, p - q)).

p is always the distribution the sampler draws from without speculation: after
logit_bias, penalties, temperature, top-k/top-p/min-p and the grammar mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def tree_walk(paths: Sequence[Sequence[int]], target: Callable[[int, int], int]) -> list[tuple[int, int]]:
    """The coupling over a token tree given as `paths` (the draft first; every path starts
    where the draft does). `target(b, j)` is the target's token after the context extended
    by `paths[b][:j]`. Starting on path 0 at depth 0, the target's token at depth j is read
    on the path b being followed; the walk goes on along b if b has it at depth j, else
    along the first path that agrees with b before j and has it there, else stops.
    Returns the (path, depth) each emitted token was read at: the kept drafts, then the
    target's own token (at the first mismatch, or the bonus token after a path's end);
    `target` is called on those alone."""
    b, j, picks = 0, 0, []
    while True:
        y = target(b, j)
        picks.append((b, j))
        if not (len(paths[b]) > j and paths[b][j] == y):
            b = next((c for c, p in enumerate(paths) if len(p) > j and p[j] == y and p[:j] == paths[b][:j]), -1)
            if b < 0:
                return picks
        j += 1


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
