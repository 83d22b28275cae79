"""Log-probabilities of chosen tokens under the model's raw distribution.

Raw means `log_softmax` of the logits the model produced, before bias, penalties,
temperature or filtering: what transformers reports, and what `select` scores choices by.
Computed as `logit - logsumexp` so no `[N, V]` log-softmax tensor is materialized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TopLogprobs:
    """The K most likely tokens of each row, most likely first."""

    values: torch.Tensor  # [N, K] float32, descending along K
    ids: torch.Tensor  # [N, K] int64


def token_logprobs(
    logits: torch.Tensor,  # [N, V]
    token_ids: torch.Tensor,  # [N] int64
    *,
    top_k: int = 0,
) -> tuple[torch.Tensor, TopLogprobs | None]:  # [N] float32, and [N, min(top_k, V)]
    """Logprob of `token_ids[i]` under `log_softmax(logits[i])`, and with `top_k > 0`
    the top-k logprobs of each row. For prompt rows, `logits[i]` is the model's
    prediction after input token i and `token_ids[i]` is input token i + 1."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = logits.gather(1, token_ids[:, None].to(torch.int64)) - lse  # [N, 1]
    if top_k <= 0:
        return chosen[:, 0], None
    values, ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)  # [N, K]
    return chosen[:, 0], TopLogprobs(values=values - lse, ids=ids)


def picked_logprobs(
    logits: torch.Tensor,  # [N, V]
    token_ids: list[Sequence[int]],  # N lists of ids, each possibly empty
) -> list[list[float]]:
    """For each row i, the logprobs of `token_ids[i]` under `log_softmax(logits[i])`, in
    that order; rows with no ids cost nothing."""
    rows = [i for i, ids in enumerate(token_ids) if ids]
    out: list[list[float]] = [[] for _ in token_ids]
    if not rows:
        return out
    width = max(len(token_ids[i]) for i in rows)
    sub = logits[rows].float()  # [R, V]
    index = torch.tensor([list(token_ids[i]) + [0] * (width - len(token_ids[i])) for i in rows], device=logits.device)
    values = (sub.gather(1, index) - torch.logsumexp(sub, dim=-1, keepdim=True)).tolist()
    for j, i in enumerate(rows):
        out[i] = values[j][: len(token_ids[i])]
    return out
