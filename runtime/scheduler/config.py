"""Scheduler settings, and the names its options take. Torch-free: the CLI builds its
flags from these. `EVICTION_POLICIES`, `GRAMMAR_BACKENDS` and `SPECULATIVE_ALGORITHMS`
are registries' keys (tests check that they agree), so that validating a name imports
no registry."""

from __future__ import annotations

from dataclasses import dataclass

from sprig.runtime.speculative.cost import PassCosts

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
EVICTION_POLICIES = ("lfu", "lru")  # the keys of radix.eviction.EVICTION_POLICIES, sorted
GRAMMAR_BACKENDS = ("outlines", "llguidance")  # the keys of constrained.REGULAR_BACKENDS
SPECULATIVE_ALGORITHMS = ("ngram", "radix", "draft")  # the keys of speculative.drafter.DRAFTERS
SGLANG_SPECULATIVE_ALGORITHMS = {"NGRAM": "ngram", "STANDALONE": "draft"}  # SGLang's names of the same drafters

SGLANG_NAMES_NOTE = (
    "SGLang's NGRAM is ngram here and STANDALONE is draft; EAGLE, EAGLE3 and NEXTN draft with heads trained on "
    "the target's hidden states, which sprig does not run: use draft with a small model of the same tokenizer"
)


MAX_WEIGHT_VERSION_CHARS = 256


def check_weight_version(version: str) -> None:
    """ValueError unless `version` is a label of 1 to `MAX_WEIGHT_VERSION_CHARS` characters."""
    if not 1 <= len(version) <= MAX_WEIGHT_VERSION_CHARS:
        raise ValueError(f"weight_version must have 1 to {MAX_WEIGHT_VERSION_CHARS} characters, got {len(version)}")


def priority_rank(priority: int, low_values_first: bool) -> int:
    """The key waiting requests are admitted by (smaller first) under priority scheduling."""
    return priority if low_values_first else -priority


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are admitted, batched and cached.

    - `schedule_policy`: the order waiting requests are admitted in. `fcfs`: arrival order.
      `lpm`: longest cached prefix first (most reuse now). `dfs-weight`: the SGLang paper's
      cache-aware order — a depth-first walk of the radix tree that visits heavier subtrees
      (more waiting requests) first, so requests that share a prefix run back to back.
    - `chunked_prefill_size`: most prompt tokens one request computes in a step; a longer
      prompt is prefilled in chunks interleaved with decode steps (None: no chunking).
    - `max_prefill_tokens`: most new tokens in one prefill step over all requests.
    - `new_token_ratio`: the share of each running request's remaining `max_new_tokens`
      reserved in the pool before admitting more work; it decays towards
      `min_new_token_ratio` while decoding goes well and resets after a retraction.
    - `in_batch_prefix_min`: a waiting request that shares at least this many uncached
      tokens (or all but its last one) with a request admitted in the same step waits a
      step, so the shared prefix is computed once and then reused.
    - `grammar_compile_timeout_s`: a regex or JSON schema that takes longer to compile
      fails its request (the compile worker is killed) instead of stalling the server.
    - `grammar_backend`: what compiles regexes, JSON schemas and choices: `outlines`
      (outlines-core: slow to compile, cheap per token) or `llguidance` (compiles in
      milliseconds, costlier per token); `ebnf` grammars and JSON schemas with free-form
      JSON (`constrained.routing`) always use llguidance.
    - `enable_jump_forward`: where a grammar admits exactly one continuation, append it
      without sampling token by token (requests that return logprobs never jump).
    - `speculative_algorithm`: the drafter of speculative decoding (None: off): `ngram`
      (prompt lookup in the request's own context), `radix` (the radix cache's most
      visited continuation) or `draft` (the greedy continuation of the draft model at
      `speculative_draft_model_path`, a checkpoint with the target's tokenizer, required
      with `draft` and refused otherwise); `speculative_num_draft_tokens` bounds the drafts verified per
      request and step (each request's length adapts to its acceptance);
      `speculative_pass_costs`: the milliseconds of the target's decode and verification
      passes and of a draft-model step (`speculative.cost.PassCosts`), which decide how
      many drafts a step verifies (none unless that is expected to be faster); None:
      measured when the engine starts and corrected by timing the passes as they run.
      `disable_draft_decoder`: run the draft model's rounds of decode steps through its
      runner (`speculative.runner_rounds`, the plain path CUDA takes) also where the
      CPU's contiguous `DraftDecoder` could run them; drafts and outputs stay exact.
      `speculative_alternatives`: most other paths a request verifies beside its draft in
      a step (a token tree: the radix drafter's less-visited branches, prompt lookup's
      earlier occurrences; with page size 1), each only where it is expected to pay
      (`speculative.cost.widen`); 0: drafts only.
    - `weight_version`: the label of the weights loaded at start, reported with every
      response until a weight update names another (`Scheduler.update_weights`).
    - `enable_priority_scheduling`: requests carry a `priority` (an int, 0 when not given;
      refused without this flag) and waiting requests are admitted by it first, then in
      `schedule_policy`'s order; higher values go first, or lower ones with
      `schedule_low_priority_values_first` (SGLang's names and defaults). A waiting request
      that has no room preempts (retracts) the running request of the lowest priority when
      it outranks it by more than `priority_scheduling_preemption_threshold`.
    """

    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = 2048
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    eviction_policy: str = "lru"
    max_queued_requests: int = 4096
    new_token_ratio: float = 0.5
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    in_batch_prefix_min: int = 32
    grammar_compile_timeout_s: float = 30.0
    grammar_backend: str = "outlines"
    enable_jump_forward: bool = True
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_pass_costs: str | None = None
    speculative_draft_model_path: str | None = None
    disable_draft_decoder: bool = False
    speculative_alternatives: int = 3
    check_integrity: bool = False
    weight_version: str = "default"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1 or None, got {self.chunked_prefill_size}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {list(EVICTION_POLICIES)}, got {self.eviction_policy!r}"
            )
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not 0.0 <= self.min_new_token_ratio <= self.new_token_ratio <= 1.0:
            raise ValueError("need 0 <= min_new_token_ratio <= new_token_ratio <= 1")
        if self.new_token_ratio_decay < 0:
            raise ValueError("new_token_ratio_decay must be >= 0")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None, got "
                             f"{self.speculative_algorithm!r} ({SGLANG_NAMES_NOTE})")
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model_path is not None):
            raise ValueError(
                "speculative_draft_model_path (--speculative-draft-model-path) is needed with speculative_algorithm "
                f"'draft' and only then; got speculative_algorithm {self.speculative_algorithm!r}, "
                f"speculative_draft_model_path {self.speculative_draft_model_path!r}"
            )
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(f"speculative_num_draft_tokens must be in [1, 64], got {self.speculative_num_draft_tokens}")
        if self.speculative_pass_costs is not None:
            PassCosts.parse(self.speculative_pass_costs)
        if not 0 <= self.speculative_alternatives <= 16:
            raise ValueError(f"speculative_alternatives must be in [0, 16], got {self.speculative_alternatives}")
        check_weight_version(self.weight_version)
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0, got "
                             f"{self.priority_scheduling_preemption_threshold}")
        if self.in_batch_prefix_min < 1:
            raise ValueError(f"in_batch_prefix_min must be >= 1, got {self.in_batch_prefix_min}")
