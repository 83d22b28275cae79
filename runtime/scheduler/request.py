"""A request as the scheduler sees it: token ids, sampling parameters, and where its KV lives."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sprig.radix import TreeNode
from sprig.radix.tree import namespaced
from sprig.runtime.multimodal.inputs import ImageInput, keyed
from sprig.runtime.request_contract import TokenizedRequest
from sprig.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    """SGLang's finish_reason: stop (on a token id or a string), length, or abort."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None  # for an abort: 400 when the request itself was bad

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
            if self.status_code is not None:
                out["status_code"] = self.status_code
        return out


@dataclass(eq=False)
class Req:
    """One sequence being generated.

    KV invariants while the request holds a row of the request-to-token table:
    - `table[row, :alloc_len]` are slots this request may use; the first `prefix_len`
      belong to the radix tree (locked through `last_node`), the rest are its own;
    - `kv_len <= alloc_len`: the first `kv_len` tokens of `fill_ids` have their KV stored;
    - while decoding, `kv_len < len(fill_ids)`: the tokens after `kv_len` (the last
      sampled one, plus any jump-forward tokens) are fed next.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None
    last_node: TreeNode | None = None
    prefix_len: int = 0
    kv_len: int = 0
    alloc_len: int = 0
    cached_tokens: int = 0
    finish: FinishReason | None = None
    retractions: int = 0
    jump_forward_tokens: int = 0
    weight_version: str = ""  # the label of the weights it runs on, set when the scheduler takes it
    priority: int = 0  # under priority scheduling (`SchedulerConfig.enable_priority_scheduling`)
    lora_name: str | None = None  # its LoRA adapter's name (None: the base model)
    lora_slot: int = -1  # that adapter's slot in the runner, set when the scheduler takes it
    # speculative decoding: the verification passes that emitted its tokens, counted by how
    # many drafts each accepted (index k: passes that kept k drafts), and the drafts verified
    spec_accept_histogram: list[int] = field(default_factory=list)
    spec_drafted: int = 0
    arrival: float = field(default_factory=time.monotonic)
    # logprobs gathered so far; entries are (logprob, token_id)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # with `token_ids_logprob`: those tokens' logprobs at each position, in its order
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs_done: bool = False
    grammar: Any = None  # the request's grammar matcher (constrained decoding), once compiled
    embed: bool = False  # ends after its prefill with `embedding` (max_new_tokens is 0)
    embedding: list[float] | None = None  # the L2-normalized final hidden state of its last prompt token
    images: tuple[ImageInput, ...] = ()  # its prompt's images, in order (`TokenizedRequest.images`)

    @classmethod
    def of(cls, request: TokenizedRequest) -> Req:
        """The scheduler's state for a request built by the request contract."""
        lp = request.logprobs
        return cls(rid=request.rid, prompt_ids=list(request.prompt_ids), params=request.params,
                   return_logprob=lp.return_logprob, logprob_start_len=lp.logprob_start_len,
                   top_logprobs_num=lp.top_logprobs_num, token_ids_logprob=lp.token_ids_logprob,
                   embed=request.embed, priority=request.priority or 0, lora_name=request.lora_path,
                   images=request.images)

    @property
    def namespace(self) -> int:
        """Its prefixes' radix namespace: its adapter's (slot + 1), or 0 for the base model
        (K/V computed with an adapter is never shared with other adapters or the base)."""
        return self.lora_slot + 1

    def cache_key(self, end: int) -> list[int]:
        """`fill_ids[:end]` as the radix tree keys them: each image's placeholders by its
        digest (`multimodal.inputs.keyed`), in its `namespace`."""
        ids = self.fill_ids
        return namespaced(keyed(ids if end >= len(ids) else ids[:end], self.images), self.namespace)

    def extend_length(self, start: int, length: int) -> int:
        """How many of the `length` tokens from `start` one step computes: as many, unless
        that cuts an image's placeholders, which are computed in one step (their tokens
        attend to each other): then up to the image, or through it when it starts at or
        before `start`."""
        end = start + length
        for image in self.images:
            if image.offset < end < image.end:
                return image.offset - start if image.offset > start else image.end - start
        return length

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV is needed before the next one can be sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """`len(fill_ids)`, without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        """`fill_ids[i]` (0 <= i < seq_len), without building the list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def pending_ids(self) -> list[int]:
        """The tokens after `kv_len` (fed next while decoding); cheap for long prompts."""
        start = self.kv_len - len(self.prompt_ids)
        if start >= 0:
            return self.output_ids[start:]
        return self.prompt_ids[self.kv_len :] + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def count_verification(self, drafted: int, kept: int) -> None:
        """Count a speculative verification pass that emitted this request's tokens:
        `drafted` drafts verified for it (a token tree's each once), `kept` of them emitted."""
        hist = self.spec_accept_histogram
        hist.extend([0] * (kept + 1 - len(hist)))
        hist[kept] += 1
        self.spec_drafted += drafted

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    @property
    def own_slots(self) -> int:
        """Slots held outside the radix tree (for the KV invariant)."""
        return self.alloc_len - self.prefix_len if self.row is not None else 0
