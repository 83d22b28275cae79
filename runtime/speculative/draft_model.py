"""Draft-model drafting: a smaller checkpoint with the target's vocabulary proposes its
greedy continuation of each request, k decode steps of a second model runner batched
across requests.

The draft's KV pool has the target's slot count and the same slot indices: one allocator,
one radix tree and one request-to-token table cover both pools (each with its own
shapes), so a prefix cached by the target can serve the draft too. The draft writes its
K/V lazily, only for the requests it drafts for, and `written` says where it holds them.
Invariant, between scheduler steps: `written[s]` implies the draft pool at slot s holds
the draft's K/V of the token the target pool holds at s, after the same prefix. It holds
because every write of the target clears `written` at its slots unless the draft wrote
the same token there in the same step:

- every extend the scheduler runs (prefill chunks, retracted requests' prompts), and
  every decode step in which no request drafted (the scheduler's plain step), clears its
  new slots (`mirror`);
- a verification pass clears the slots of the tokens it fed that the draft did not (the
  pending tokens of a request it did not draft for, the last kept draft) and of the
  drafts it rejected, before any token is emitted (`verified`);
- the draft's own passes set `written` at the slots they write.

Drafting for a request feeds the draft every token of its context from the first
position whose slot is not `written` through its pending token, then proposes k tokens,
in one round of decode steps batched across requests: a request's few unwritten tokens
(at most `FEED_STEPS`: usually the pending token, or the last kept draft and the pending
token) are fed one a step, the round's first steps; a request with more to feed (a
prompt), or whose unwritten slots another request of the round also feeds (samples of a
prompt sharing a prefix the draft has not written), first catches up in an extend on the
runner. A request the scheduler runs without drafts for a while (`cost.draft_cap` chose
none) costs the draft nothing until it drafts again. On the CPU the rounds run in
`draft_decoder.DraftDecoder` (contiguous copies of the contexts, gathered once); its
runner's steps are extends only (and, in the decoder's shadow mode, decode steps that
write each slot just before the decoder writes it again), so the CPU attention backend's
K/V kept between decode steps (`kept_kv`), cleared by every extend, never holds what the
decoder has since overwritten. Elsewhere (CUDA: graph-replayed steps) they run through
the runner's general decode path (`runner_rounds.RunnerRounds`).

The proposals are the draft's argmax tokens, among those the request's grammar allows
after the proposals before them for a constrained request (`grammar_drafts.GrammarWalk`;
the grammar is rolled back after): a deterministic drafter, accepted by the
coupling `accept.tree_walk` at every temperature, so greedy outputs equal plain decoding's
and a seeded request's tokens do not depend on whether speculation is on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sprig.radix import RadixCache
from sprig.radix.tree import TOKEN_MASK
from sprig.runtime.forward_batch import ForwardMode
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.models import supported_architectures
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.speculative.draft_decoder import DraftDecoder
from sprig.runtime.speculative.draft_decoder import supports as supports_contiguous
from sprig.runtime.speculative.grammar_drafts import GrammarWalk
from sprig.runtime.speculative.runner_rounds import RunnerRounds
from sprig.runtime.speculative.timing import timed_ms
from sprig.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from sprig.runtime.scheduler.kv import RequestKV
    from sprig.runtime.scheduler.request import Req

FLAG = "--speculative-draft-model-path"
FEED_STEPS = 4  # a request feeds at most this many tokens to the draft in a round's steps (more: an extend first)


def draft_runner_config(path: str, target: ModelRunner) -> RunnerConfig:
    """The target's runner settings for the draft checkpoint at `path`: the same device,
    dtype, attention backend, page size and KV storage, exactly the target's slot count
    and context length, no weight quantization, no LoRA adapters (the draft proposes as the
    base model; the target verifies each request with its adapter)."""
    dtype = str(target.dtype).removeprefix("torch.")  # one of runner_config.DTYPES: the target resolved it
    return replace(
        target.config, model_path=path, dtype=dtype, max_total_tokens=target.num_slots, quantization=None,
        context_length=target.model_config.context_len, enable_lora=False, lora_paths=(),
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

    def __init__(self, path: str, target: ModelRunner, *, contiguous: bool = True) -> None:
        """`contiguous`: run rounds in `DraftDecoder` where it supports the draft's runner
        (else, and where it does not, through the runner: `RunnerRounds`)."""
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
                             f"the target ({e}); lower --mem-fraction-static or --max-total-tokens") from None
        if self.runner.num_slots != target.num_slots:
            raise AssertionError(f"draft pool {self.runner.num_slots} slots, target's {target.num_slots}")
        rows = self.runner.kv_cache.num_slots + self.runner.kv_cache.page_size
        self.written = torch.zeros(rows, dtype=torch.bool)  # [rows]
        self.wrote = torch.full((rows, 2), -1, dtype=torch.int64)  # [rows, (token, position)] last draft write
        self.rounds = (DraftDecoder(self.runner, shadow=config.shadow_attention)
                       if contiguous and supports_contiguous(self.runner) else RunnerRounds(self.runner))
        self.extend_s = 0.0  # seconds the last `draft` spent in extends (catching up on prompts)

    def step_ms(self, batch: int, context: int, first_slot: int, steps: int) -> float:
        """Milliseconds a decode step of the draft takes in a round of `steps` for `batch`
        requests of `context`-token contexts (`steps <= context`), measured on garbage
        K/V in the slots from `first_slot` (one context per request): for calibration,
        with every slot free."""
        slots = [torch.arange(first_slot + b * context, first_slot + (b + 1) * context) for b in range(batch)]
        starts = [context - steps] * batch
        return timed_ms(lambda: self.rounds.run(slots, starts, [[0]] * batch, [steps] * batch)) / steps

    def draft(self, kv: RequestKV, batch: list[Req], lengths: list[int],
              cap: Callable[[list[int]], int]) -> list[list[int]]:
        """`min(lengths[i], cap(lengths))` argmax drafts for `batch[i]` (each with one
        pending token where `lengths[i] > 0`), under its grammar if it has one (the grammar
        is left where it was); a request whose draft slots the free list
        cannot supply drafts nothing. Requests with more than `FEED_STEPS` tokens to feed
        (a prompt), or whose tokens to feed lie in slots another request also feeds, catch
        up on the runner (`_feed_pass`: an extend, which also proposes their first draft)
        until every other request has at most `FEED_STEPS` tokens of its own to feed (the
        samples of a prompt wait for the first of them to feed their shared slots); then
        `self.rounds` feeds those and proposes every remaining draft in one round."""
        drafts: list[list[int]] = [[] for _ in batch]
        self.extend_s = 0.0
        most = cap(lengths)
        if most == 0:
            return drafts
        ks = [min(k, most) for k in lengths]
        ks = [k if k and kv.reserve_free(r, r.seq_len + k) else 0 for r, k in zip(batch, ks, strict=True)]
        live = [i for i, k in enumerate(ks) if k]
        if not live:
            return drafts
        reqs = [batch[i] for i in live]
        walk = GrammarWalk([r.grammar for r in reqs]) if any(r.grammar is not None for r in reqs) else None
        try:
            return self._propose(kv, reqs, [ks[i] for i in live], walk, drafts, live)
        finally:
            if walk is not None:
                walk.close()

    def _propose(self, kv: RequestKV, reqs: list[Req], ks: list[int], walk: GrammarWalk | None,
                 drafts: list[list[int]], live: list[int]) -> list[list[int]]:
        """`draft`'s proposals: `ks[j]` for `reqs[j]` (its slots reserved), each put in
        `drafts[live[j]]`."""
        caught: dict[int, int] = {}  # position in `reqs` -> its first draft
        while True:
            todo = [j for j in range(len(reqs)) if j not in caught]
            ends = [reqs[j].seq_len for j in todo]
            firsts = first_unwritten(self.written[kv.contexts([reqs[j] for j in todo], ends)], ends) if todo else []
            taken: set[int] = set()
            behind = []
            for j, first, end in zip(todo, firsts, ends, strict=True):
                slots = set(kv.table.read(reqs[j].row, end, first).tolist())
                if end - first > FEED_STEPS or slots & taken:
                    behind.append(j)
                taken |= slots
            if not behind:
                break
            fed = self._feed_pass(kv, [reqs[j] for j in behind], None if walk is None else walk.over(behind))
            caught.update((behind[b], token) for b, token in fed)
        start_of = dict(zip(todo, firsts, strict=True))
        for j, token in caught.items():
            drafts[live[j]].append(token)
        rows = todo + [j for j in caught if ks[j] > 1]
        if not rows:
            return drafts
        starts = [start_of.get(j, reqs[j].seq_len) for j in rows]
        tokens = [[caught[j]] if j in caught else reqs[j].fill_ids[start_of[j] : reqs[j].seq_len] for j in rows]
        wanted = [ks[j] - (j in caught) for j in rows]
        reads = [start + len(t) - 1 + n for start, t, n in zip(starts, tokens, wanted, strict=True)]
        slots = [kv.table.read(reqs[j].row, end) for j, end in zip(rows, reads, strict=True)]
        proposals = self.rounds.run(slots, starts, tokens, wanted, None if walk is None else walk.over(rows))
        for j, start, end, fed, proposed, row_slots in zip(rows, starts, reads, tokens, proposals, slots, strict=True):
            drafts[live[j]] += proposed
            self._wrote(row_slots[start:end], fed + proposed[:-1], torch.arange(start, end))
        return drafts

    def _feed_pass(self, kv: RequestKV, reqs: list[Req], walk: GrammarWalk | None) -> list[tuple[int, int]]:
        """One pass of the runner feeding requests their tokens from the first position
        without draft K/V through their pending token: (index in `reqs`, first draft) of
        each request it fed (the argmax among what its grammar allows, where `walk`, over
        `reqs`, walks one). Requests sharing a cached prefix the draft has not written
        (samples of one prompt) would write the same slots in one pass, which no step may
        do: the first of them is fed, the others are left for a later pass (which then
        starts after the slots this one wrote)."""
        ends = [r.seq_len for r in reqs]
        firsts = first_unwritten(self.written[kv.contexts(reqs, ends)], ends)
        taken: set[int] = set()
        now: list[int] = []
        for j, (r, first, end) in enumerate(zip(reqs, firsts, ends, strict=True)):
            slots = set(kv.table.read(r.row, end, first).tolist())
            if not slots & taken:
                now.append(j)
                taken |= slots
        step = ForwardStep(
            mode=ForwardMode.DECODE if all(ends[j] - firsts[j] == 1 for j in now) else ForwardMode.EXTEND,
            input_ids=[t for j in now for t in reqs[j].fill_ids[firsts[j] : ends[j]]],
            q_lens=[ends[j] - firsts[j] for j in now],
            kv_lens=[ends[j] for j in now],
            kv_indices=kv.contexts([reqs[j] for j in now], [ends[j] for j in now]),
            logits_from=[ends[j] - firsts[j] - 1 for j in now],
        )
        begun = time.perf_counter()
        logits = self.runner.forward(step)  # [len(now), V]
        if step.mode is ForwardMode.EXTEND:
            self.extend_s += time.perf_counter() - begun
        self._record(step)
        if walk is not None:
            walk.mask(logits, list(enumerate(now)))
        tokens = logits.argmax(dim=-1).tolist()
        if walk is not None:
            for j, token in zip(now, tokens, strict=True):
                walk.take(j, token)
        return list(zip(now, tokens, strict=True))

    def _record(self, step: ForwardStep) -> None:
        """The draft wrote the K/V of `step`'s new tokens at their slots."""
        slots, positions = new_tokens(step.kv_indices, step.kv_lens, step.q_lens)
        self._wrote(slots, step.input_ids, positions)

    def _wrote(self, slots: torch.Tensor, tokens: list[int], positions: torch.Tensor) -> None:
        """The draft wrote the K/V of `tokens` at `positions` into `slots`."""
        self.written[slots] = True
        self.wrote[slots, 0] = torch.tensor(tokens, dtype=torch.int64)
        self.wrote[slots, 1] = positions

    def mirror(self, step: ForwardStep) -> None:
        """The target wrote `step`'s new tokens: the draft does not hold their K/V."""
        self.written[new_tokens(step.kv_indices, step.kv_lens, step.q_lens)[0]] = False

    def alternatives(self, batch: list[Req], drafts: list[list[int]], limits: list[int],
                     width: int) -> list[list[list[int]]]:
        """None: the draft model proposes one path."""
        return [[] for _ in batch]

    def verified(self, kv: RequestKV, batch: list[Req], drafts: list[list[int]], kept: list[int]) -> None:
        """The target fed each request its pending tokens and drafts at positions from
        `kv_len`; the draft holds only the kept ones it fed (its pending token and drafts
        but the last, when it drafted)."""
        stale = []
        for req, draft, n in zip(batch, drafts, kept, strict=True):
            fed = req.seq_len - req.kv_len + len(draft)
            first_kept_unfed = req.kv_len + min(n, fed - 1) if draft else req.kv_len
            stale.append(kv.table.read(req.row, req.kv_len + fed, first_kept_unfed))
        self.written[torch.cat(stale)] = False

    def check(self, kv: RequestKV) -> None:
        """Shadow check of the module's invariant (with `check_integrity`, between steps):
        every slot a request or the radix tree holds that is flagged `written` was last
        written by the draft for the token and position it holds now."""
        for req in kv.holders:
            ids = torch.tensor(req.fill_ids[: req.kv_len], dtype=torch.int64)
            self._check_slots(kv.table.read(req.row, req.kv_len), ids, 0, f"request {req.rid}")
        stack = [(kv.cache.root, 0)] if isinstance(kv.cache, RadixCache) else []
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                tokens = torch.from_numpy(child.key).to(torch.int64) & TOKEN_MASK  # keys of any namespace
                self._check_slots(child.value, tokens, depth, "the radix tree")
                stack.append((child, depth + len(child)))

    def _check_slots(self, slots: torch.Tensor, ids: torch.Tensor, start: int, holder: str) -> None:
        held = self.written[slots]
        want = torch.stack([ids, torch.arange(start, start + ids.shape[0])], dim=1)[held]
        bad = (self.wrote[slots[held]] != want).any(dim=1)
        if bad.any():
            slot = int(slots[held][bad][0])
            raise AssertionError(f"draft KV: slot {slot} of {holder} is flagged written for (token, position) "
                                 f"{self.wrote[slot].tolist()} but holds {want[bad][0].tolist()}")


def new_tokens(contexts: torch.Tensor, kv_lens: list[int], q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots and positions of each request's last `q_lens[i]` tokens in `contexts`
    (the requests' `kv_lens[i]` context slots, concatenated)."""
    kv = torch.tensor(kv_lens, dtype=torch.int64)  # [B]
    q = torch.tensor(q_lens, dtype=torch.int64)  # [B]
    offsets = torch.arange(int(q.sum())) - torch.repeat_interleave(q.cumsum(0) - q, q)  # [sum(q)]
    positions = torch.repeat_interleave(kv - q, q) + offsets  # [sum(q)]
    return contexts[torch.repeat_interleave(kv.cumsum(0) - kv, q) + positions], positions


def first_unwritten(written: torch.Tensor, lens: list[int]) -> list[int]:
    """Per request, the first position whose slot the draft has not written (`written`:
    the requests' context flags concatenated, `lens[i]` each), at most its last."""
    n = torch.tensor(lens, dtype=torch.int64)  # [B]
    position = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # [sum(n)]
    owner = torch.repeat_interleave(torch.arange(len(lens)), n)  # [sum(n)]
    candidates = torch.where(written, n[owner] - 1, position)  # [sum(n)]
    return torch.full((len(lens),), 0, dtype=torch.int64).scatter_reduce(
        0, owner, candidates, "amin", include_self=False).tolist()
