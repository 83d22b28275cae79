"""A round of the draft model's decode steps through its runner's general path: the plain
counterpart of `draft_decoder.DraftDecoder`, with the same contract, used wherever that
one does not apply (on CUDA, where each step replays a CUDA graph of the runner's decode
pass; a sharded or non-Llama draft).

A request catching up on a few tokens (the last kept draft and its pending token) feeds
them as decode steps of the round, one at a time, rather than in an extend of its own:
on CUDA an extend runs eagerly and costs several graph-replayed decode steps.
"""

from __future__ import annotations

import torch

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.speculative.grammar_drafts import GrammarWalk


def round_step(slots: list[torch.Tensor], starts: list[int], fed: list[int], live: list[int], j: int) -> ForwardStep:
    """Step `j` of a round: the `live` requests each feed `fed[b]` at position
    `starts[b] + j`, attending to `slots[b]` up to it."""
    ends = [starts[b] + j + 1 for b in live]
    return ForwardStep(
        mode=ForwardMode.DECODE,
        input_ids=[fed[b] for b in live],
        q_lens=[1] * len(live),
        kv_lens=ends,
        kv_indices=torch.cat([slots[b][:end] for b, end in zip(live, ends, strict=True)]),
        logits_from=[0] * len(live),
    )


class RunnerRounds:
    """`DraftDecoder.run`'s contract, one `ModelRunner.forward` decode step at a time."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(self, slots: list[torch.Tensor], starts: list[int], tokens: list[list[int]],
            drafts: list[int], walk: GrammarWalk | None = None) -> list[list[int]]:
        """Request b is fed `tokens[b]` one step at a time from position `starts[b]`, then
        each token it proposes (the argmax among what its grammar allows, where `walk`
        walks one), until it has proposed `drafts[b] >= 1` tokens after the last of
        `tokens[b]`; returns the proposals. The K/V of the token fed at position p is
        written at `slots[b][p]`; the first `starts[b]` positions' K/V must be there."""
        steps = [len(t) - 1 + n for t, n in zip(tokens, drafts, strict=True)]
        fed = [t[0] for t in tokens]
        out: list[list[int]] = [[] for _ in slots]
        for j in range(max(steps)):
            live = [b for b in range(len(slots)) if steps[b] > j]
            logits = self.runner.forward(round_step(slots, starts, fed, live, j))  # [len(live), V]
            if walk is not None:
                walk.mask(logits, [(i, b) for i, b in enumerate(live) if j + 1 >= len(tokens[b])])
            for b, token in zip(live, logits.argmax(dim=-1).tolist(), strict=True):
                if j + 1 < len(tokens[b]):
                    fed[b] = tokens[b][j + 1]
                else:
                    out[b].append(token)
                    fed[b] = token
                    if walk is not None:
                        walk.take(b, token)
        return out
