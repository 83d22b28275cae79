"""Draft-model drafting: a smaller checkpoint with the target's vocabulary proposes its
greedy continuation of each request, k decode steps of a second model runner batched
across requests.

The draft's KV pool has the target's slot count and the same slot indices: one allocator,
one radix tree and one request-to-token table cover both pools (each with its own
shapes). Invariant, between scheduler steps: for every slot the radix tree holds, and for
every slot a request holds at positions `[0, kv_len)` (its verified tokens), the draft
pool holds the draft's K/V of that same token at that same position. So a prefix cached
by the target serves the draft too, and slots freed by a finish, an abort, a retraction
or a rejected draft are freed for both pools at once (they are one slot). It holds
because:

- every extend the scheduler runs (prefill chunks) runs on the draft right after the
  target, over the same `ForwardStep`, hence the same slots (`mirror`);
- drafting k tokens for a request feeds its pending token and its drafts `d_1 ..
  d_{k-1}`, writing their K/V at positions `kv_len .. kv_len + k - 1`;
- once a verification pass knows how many of the fed tokens it keeps, and before any is
  emitted (an emitted token may finish the request, whose release inserts its verified
  tokens into the tree), the draft writes the kept ones it has not written: `d_k` when
  every draft is kept, the pending tokens of a request it did not draft for (`verified`).
  Rejected drafts' K/V sits in slots freed the same step.

The proposals are the draft's argmax tokens: a deterministic drafter, accepted by the
coupling `accepted_length` at every temperature, so greedy outputs equal plain decoding's
and a seeded request's tokens do not depend on whether speculation is on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import DTYPES, ModelRunner, RunnerConfig
from sprig.runtime.models import supported_architectures
from sprig.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from sprig.runtime.scheduler.kv import RequestKV
    from sprig.runtime.scheduler.request import Req

FLAG = "--speculative-draft-model-path"


def draft_runner_config(path: str, target: ModelRunner) -> RunnerConfig:
    """The target's runner settings for the draft checkpoint at `path`: the same device,
    dtype, attention backend, page size and KV storage, exactly the target's slot count
    and context length, no weight quantization."""
    dtype = next(name for name, d in DTYPES.items() if d == target.dtype)
    return replace(
        target.config, model_path=path, dtype=dtype, max_total_tokens=target.num_slots, quantization=None,
        context_length=target.model_config.context_len,
    )


def check_same_vocabulary(draft_path: str, target_path: str, draft_vocab: int, target_vocab: int) -> None:
    """ValueError naming the flag unless the draft has the target's vocabulary size and a
    tokenizer that maps every token to the target tokenizer's id."""
    if draft_vocab != target_vocab:
        raise ValueError(f"{FLAG} {draft_path!r}: the draft's vocabulary has {draft_vocab} entries, "
                         f"the target's {target_vocab}; a draft must share the target's vocabulary")
    try:
        draft_tokens = load_tokenizer(draft_path).get_vocab()
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e} (the draft must ship the target's tokenizer)") from None
    if draft_tokens != load_tokenizer(target_path).get_vocab():
        raise ValueError(f"{FLAG} {draft_path!r}: the draft's tokenizer maps tokens to other ids than the "
                         "target's; a draft must share the target's tokenizer")


class DraftModel:
    """The `draft` drafter: owns the draft's `ModelRunner` (see the module's invariant)."""

    def __init__(self, path: str, target: ModelRunner) -> None:
        if not Path(path).is_dir():
            raise ValueError(f"{FLAG} {path!r} is not a directory")
        config = draft_runner_config(path, target)
        try:  # config.json alone: the checks come before the weights load
            model = ModelConfig.from_pretrained(path, context_length=config.context_length,
                                                supported=supported_architectures())
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{FLAG} {path!r}: {e}") from None
        check_same_vocabulary(path, str(target.config.model_path), model.vocab_size, target.model_config.vocab_size)
        try:
            self.runner = ModelRunner(config)
        except torch.OutOfMemoryError as e:  # the target's pool took the memory first
            raise ValueError(f"{FLAG}: the draft model and a KV pool of {target.num_slots} slots do not fit beside "
                             f"the target ({e}); lower --mem-fraction-static or set --max-total-tokens") from None
        if self.runner.num_slots != target.num_slots:
            raise AssertionError(f"draft pool {self.runner.num_slots} slots, target's {target.num_slots}")

    def draft(self, kv: RequestKV, batch: list[Req], lengths: list[int],
              worth: Callable[[list[int]], bool]) -> list[list[int]]:
        """`lengths[i]` argmax drafts for `batch[i]` (each with one pending token where
        `lengths[i] > 0`), or none at all unless `worth(lengths)`; a request whose draft
        slots the free list cannot supply drafts nothing. Step j feeds each request
        still drafting its token at position `seq_len - 1 + j`."""
        drafts: list[list[int]] = [[] for _ in batch]
        if not worth(lengths):
            return drafts
        ks = [k if k and kv.reserve_free(r, r.seq_len + k) else 0 for r, k in zip(batch, lengths, strict=True)]
        tokens = [r.fill_ids[-1] for r in batch]
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if k > j]
            reqs = [batch[i] for i in live]
            ends = [r.seq_len + j for r in reqs]
            step = ForwardStep(
                mode=ForwardMode.DECODE,
                input_ids=[tokens[i] for i in live],
                q_lens=[1] * len(live),
                kv_lens=ends,
                kv_indices=kv.contexts(reqs, ends),
                logits_from=[0] * len(live),
            )
            for i, token in zip(live, self.runner.forward(step).argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
                tokens[i] = token
        return drafts

    def mirror(self, step: ForwardStep) -> None:
        """Write the draft's K/V of `step`'s new tokens at their slots (the target just ran
        `step`); only one row of logits per request is computed, and dropped."""
        self.runner.forward(replace(step, logits_from=[q - 1 for q in step.q_lens]))

    def verified(self, kv: RequestKV, batch: list[Req], drafts: list[list[int]], kept: list[int]) -> None:
        """Write the draft's K/V of the kept tokens drafting did not feed: of `batch[i]`'s
        pending tokens and drafts, drafting fed the first `len(drafts[i])`."""
        todo = [(r, (r.pending_ids() + d)[len(d) : n], n) for r, d, n in zip(batch, drafts, kept, strict=True)]
        todo = [t for t in todo if t[1]]
        if not todo:
            return
        reqs = [r for r, _, _ in todo]
        q_lens = [len(tokens) for _, tokens, _ in todo]
        ends = [r.kv_len + n for r, _, n in todo]  # the context ends with the last kept token
        step = ForwardStep(
            mode=ForwardMode.DECODE if max(q_lens) == 1 else ForwardMode.EXTEND,
            input_ids=[t for _, tokens, _ in todo for t in tokens],
            q_lens=q_lens,
            kv_lens=ends,
            kv_indices=kv.contexts(reqs, ends),
            logits_from=[q - 1 for q in q_lens],
        )
        self.runner.forward(step)
