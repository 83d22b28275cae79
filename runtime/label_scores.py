"""Label scores, SGLang's `score` (`Engine.score`, `POST /v1/score`): for each item, how
likely each of some label tokens is as the next token after `query + item`.

Each item makes one prompt: the text `query + item` (`item + query` with `item_first`)
tokenized as one string, as SGLang joins them, or the two id lists joined when both are
token ids. The prompt runs for one greedy token with the labels as `token_ids_logprob`,
and an item's scores are read from the labels' logprobs at that first output position:
`exp(logprob)`, each label's probability under the model's whole next-token distribution,
or with `apply_softmax` those probabilities renormalized over the labels alone (they then
sum to 1). The logprobs are raw (`log_softmax` of the logits), so the result does not
depend on sampling parameters; items that share a leading query share its KV through the
radix cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sprig.runtime.request_contract import (
    MAX_TOKEN_IDS_LOGPROB,
    InvalidRequest,
    LogprobOptions,
    ModelLimits,
)

SCORE_SAMPLING: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}


@dataclass(frozen=True)
class ScoreCall:
    """One checked scoring call: a prompt per item, every one shorter than the context
    (so its one output token fits) and of ids in the vocabulary, and 1 to
    `MAX_TOKEN_IDS_LOGPROB` labels in the vocabulary."""

    prompts: list[list[int]]
    labels: tuple[int, ...]
    apply_softmax: bool

    @property
    def logprobs(self) -> LogprobOptions:
        """What each prompt's request reports: the labels' logprobs at its output position."""
        return LogprobOptions(return_logprob=True, token_ids_logprob=self.labels)

    def scores(self, outputs: Sequence[dict[str, Any]]) -> list[list[float]]:
        """Each item's scores, in the order of the labels, from its request's response
        (`/generate`'s schema)."""
        out = []
        for response in outputs:
            logprobs = [e[0] for e in response["meta_info"]["output_token_ids_logprobs"][0]]
            out.append(_softmax(logprobs) if self.apply_softmax else [math.exp(lp) for lp in logprobs])
        return out


def score_call(query: Any, items: Any, label_token_ids: Any, apply_softmax: Any, item_first: Any, *,
               limits: ModelLimits, encode: Callable[[str], list[int]]) -> ScoreCall:
    """Check a scoring call's arguments and build its prompts (`encode` tokenizes text).
    `query` is a string or a list of token ids; `items` a string, a list of strings or a
    list of id lists, of the same kind as `query`. Raises `InvalidRequest` naming the field
    at fault."""
    for name, flag in (("apply_softmax", apply_softmax), ("item_first", item_first)):
        if not isinstance(flag, bool):
            raise InvalidRequest(f"{name} must be true or false", name)
    labels = _labels(label_token_ids, limits.vocab_size)
    if query is None:
        raise InvalidRequest("query is required: a string or a list of token ids", "query")
    if items is None:
        raise InvalidRequest("items is required: a string, a list of strings or a list of token id lists", "items")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("items must be a non-empty list", "items")
    if isinstance(query, str) and all(isinstance(i, str) for i in items):
        texts = [i + query if item_first else query + i for i in items]
        if "" in texts:
            raise InvalidRequest(f"query + items[{texts.index('')}] is empty: there is nothing to score after",
                                 "items")
        prompts = [encode(t) for t in texts]
    elif _is_ids(query) and all(_is_ids(i) for i in items):
        _check_vocab(query, limits, "query")
        for item in items:
            _check_vocab(item, limits, "items")
        prompts = [item + query if item_first else query + item for item in items]
    else:
        raise InvalidRequest("query and items must both be text, or both token ids (a list of ints, and a "
                             "list of lists of ints)", "items")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise InvalidRequest(f"query + items[{i}] is empty: there is nothing to score after", "items")
        if len(prompt) >= limits.context_len:
            raise InvalidRequest(f"query + items[{i}] has {len(prompt)} tokens; the model's context length "
                                 f"({limits.context_len}) leaves room for at most {limits.context_len - 1}", "items")
    return ScoreCall(prompts, labels, apply_softmax)


def _labels(value: Any, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value or not all(_is_id(t) for t in value):
        raise InvalidRequest("label_token_ids must be a non-empty list of token ids", "label_token_ids")
    if len(value) > MAX_TOKEN_IDS_LOGPROB:
        raise InvalidRequest(f"label_token_ids has {len(value)} ids; at most {MAX_TOKEN_IDS_LOGPROB}",
                             "label_token_ids")
    if bad := [t for t in value if not 0 <= t < vocab_size]:
        raise InvalidRequest(f"label_token_ids has token ids outside [0, {vocab_size}): {bad[:5]}", "label_token_ids")
    return tuple(value)


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_id(t) for t in value)


def _check_vocab(ids: list[int], limits: ModelLimits, field: str) -> None:
    if bad := [t for t in ids if not 0 <= t < limits.vocab_size]:
        raise InvalidRequest(f"{field} has token ids outside [0, {limits.vocab_size}): {bad[:5]}", field)


def _softmax(logprobs: list[float]) -> list[float]:
    """The labels' probabilities renormalized among themselves (finite logprobs: no
    constraint masks a scoring request's logits)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
