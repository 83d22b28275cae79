"""Token embedding and the output projection to vocabulary logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # [V, H]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to float32 logits. A tied head owns no weight: it is given the
    embedding's at call time (tying by shared Parameter does not survive `to_empty`)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tied: bool) -> None:
        super().__init__()
        self.weight = None if tied else nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(
        self,
        hidden: torch.Tensor,  # [R, H]
        embedding: VocabEmbedding,
    ) -> torch.Tensor:  # [R, V] float32
        weight = embedding.weight if self.weight is None else self.weight
        return F.linear(hidden, weight).float()
