"""Drafters: cheap guesses of a request's next tokens, verified by the target model.

Every drafter is deterministic (its draft distribution q is one-hot at each proposed
token), so the coupling `accept.tree_walk` keeps the output exact. Two kinds:

- context drafters (`ContextDrafter`: `propose(context, k)`), pure with respect to the KV
  pool (they may read the radix tree but never lock, split or evict): `ngram`, `radix`;
  `ContextDrafts` runs one per request;
- the draft model (`draft_model.DraftModel`), which runs a second model runner over the
  target's slots.

`DRAFTERS` maps each `--speculative-algorithm` to a factory taking the scheduler config,
the prefix cache and the target's runner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from sprig.radix import PrefixCache
from sprig.radix.tree import TOKEN_MASK
from sprig.runtime.forward_step import ForwardStep
from sprig.runtime.model_runner import ModelRunner
from sprig.runtime.multimodal.inputs import IMAGE_KEY_BASE
from sprig.runtime.speculative.draft_model import DraftModel
from sprig.runtime.speculative.ngram import NgramDrafter
from sprig.runtime.speculative.radix_drafter import RadixDrafter

if TYPE_CHECKING:
    from sprig.runtime.scheduler.config import SchedulerConfig
    from sprig.runtime.scheduler.kv import RequestKV
    from sprig.runtime.scheduler.request import Req


class Drafter(Protocol):
    runner: ModelRunner | None  # the draft model's runner (None: drafting runs no model)

    def draft(self, kv: RequestKV, batch: list[Req], lengths: list[int],
              cap: Callable[[list[int]], int]) -> list[list[int]]:
        """At most `min(lengths[i], cap(sizes))` drafts for `batch[i]`, where `sizes[i] <=
        lengths[i]` are the drafts it could propose; their slots reserved from the free
        list only (`RequestKV.reserve_free`; a request it cannot serve gets none)."""
        ...

    def mirror(self, step: ForwardStep) -> None:
        """The target has just run `step`, an extend (prefill chunks) or a plain decode step
        (nothing drafted): keep any state over the target's slots in step with it."""
        ...

    def alternatives(self, batch: list[Req], drafts: list[list[int]], limits: list[int],
                     width: int) -> list[list[list[int]]]:
        """Up to `width` other paths for each request with a draft (of `limits[i]` tokens at
        most; each starts where the draft does and differs from it), verified beside it:
        a token tree. Only for one-hot drafts (the coupling walks the tree)."""
        ...

    def verified(self, kv: RequestKV, batch: list[Req], drafts: list[list[int]], kept: list[int]) -> None:
        """A verification pass fed `batch[i]` its pending tokens, then `drafts[i]`, and keeps
        the first `kept[i]` of them (the target's own token after them is pending next):
        called before any is emitted, while the request still holds their slots. Where the
        pass verified alternatives, `drafts[i]` is the path the tokens kept lie on."""
        ...

    def check(self, kv: RequestKV) -> None:
        """Raise AssertionError if state kept over the target's slots is out of step with
        them (`check_integrity`, between steps)."""
        ...


class ContextDrafter(Protocol):
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """At most `k` tokens guessed to follow `context` (the request's prompt + output)."""
        ...

    def alternatives(self, context: Sequence[int], k: int, width: int) -> list[list[int]]:
        """At most `width` paths of at most `k` tokens, other than `propose(context, k)`,
        each starting where it does (none for a drafter that proposes one path)."""
        ...


class ContextDrafts:
    """A `Drafter` of one `ContextDrafter` run per request; it keeps no KV of its own."""

    runner = None

    def __init__(self, drafter: ContextDrafter) -> None:
        self.drafter = drafter

    def draft(self, kv: RequestKV, batch: list[Req], lengths: list[int],
              cap: Callable[[list[int]], int]) -> list[list[int]]:
        if cap(lengths) == 0:  # not worth it even if every request proposed all it may: propose nothing
            return [[] for _ in batch]
        proposals = [_plain(self.drafter.propose(r.cache_key(r.seq_len), k), r) if k > 0 else []
                     for r, k in zip(batch, lengths, strict=True)]
        most = cap([len(p) for p in proposals])
        proposals = [p[:most] for p in proposals]
        return [p if p and kv.reserve_free(r, r.seq_len + len(p)) else [] for r, p in zip(batch, proposals, strict=True)]

    def alternatives(self, batch: list[Req], drafts: list[list[int]], limits: list[int],
                     width: int) -> list[list[list[int]]]:
        return [[_plain(p, r) for p in self.drafter.alternatives(r.cache_key(r.seq_len), k, width)] if d else []
                for r, d, k in zip(batch, drafts, limits, strict=True)]

    def mirror(self, step: ForwardStep) -> None:
        pass

    def verified(self, kv: RequestKV, batch: list[Req], drafts: list[list[int]], kept: list[int]) -> None:
        pass

    def check(self, kv: RequestKV) -> None:
        pass


def _draft_model(config: SchedulerConfig, cache: PrefixCache, runner: ModelRunner) -> Drafter:
    assert config.speculative_draft_model_path is not None  # SchedulerConfig checks it
    return DraftModel(config.speculative_draft_model_path, runner, contiguous=not config.disable_draft_decoder)


DRAFTERS: dict[str, Callable[[SchedulerConfig, PrefixCache, ModelRunner], Drafter]] = {
    "ngram": lambda config, cache, runner: ContextDrafts(NgramDrafter()),
    "radix": lambda config, cache, runner: ContextDrafts(RadixDrafter(cache)),
    "draft": _draft_model,
}


def _plain(keys: list[int], req: Req) -> list[int]:
    """Tokens from keys of `req`'s radix namespace: a drafter sees a request's context as
    the tree keys it (`Req.cache_key`), so the radix drafter reads only continuations
    cached under the same adapter; an n-gram drafter finds the same matches either way.
    A proposal ends before the first key of an image's placeholders (no token)."""
    tokens = [t & TOKEN_MASK for t in keys] if req.namespace else keys
    for i, t in enumerate(tokens):
        if t >= IMAGE_KEY_BASE:
            return tokens[:i]
    return tokens
