"""The engine's differential fuzzer: random workloads under random engine configs, every
request checked against itself run alone, and against transformers.

A workload is a set of requests — prompts with and without shared prefixes (some
identical), random `max_new_tokens`, stops on EOS, stop strings or `stop_token_ids` at
different steps, `n > 1`, greedy and seeded sampling, penalties and logit bias, logprobs
(with input logprobs from random starts), a regex on the whole output or from a trigger
text on (`constraint_trigger`), in `THINKING_SHARE` of them deferred past a reasoning end
marker (`reasoning_end`, a reasoning model's gate: a special token or plain text; with a start
marker the output may open, and with an exit token that may end the output while thinking;
half of those, and `BUDGET_SHARE` of the unconstrained requests, with a `thinking_budget`
that closes the reasoning: their own generator), compiled by outlines-core, by llguidance (the engine's
`grammar_backend`, in `GUIDED_SHARE` of workloads; their alone runs and reference masks use
it too) or, as a Lark grammar holding it (as the server sends tools' grammars), by
llguidance whatever the backend, arrivals spread over steps and aborts mid-flight, and
embedding requests (`EMBED_SHARE`; `Engine.encode`'s, drawn by a generator of their own:
in an older seed's workload some requests became embeddings, the rest are unchanged) — plus unseeded sampled requests that
run beside them unchecked. It runs on an
engine with random settings (chunk sizes, page sizes 1/4/16, pools small enough to
retract, radix on or off, few or many running requests, each schedule policy, either
attention backend, a float or an int8 KV cache, float or int4 weights, speculative
decoding off or with any drafter (the draft model: the target's first layer,
`draft_checkpoints.truncated_draft`, its rounds in the CPU's draft decoder or through its
runner as on CUDA; token trees up to 4 paths; half of the prompt-lookup workloads draft
from `PerturbedTrees`, which knows the outputs, so constrained requests' drafts are kept
too; alone runs never speculate), in shadow mode,
driven step by step through the scheduler, on one of the given models (dense, or in
`MOE_SHARE` of workloads a mixture-of-experts one: routing is per token, so a request's
experts never depend on its batch; `SINK_SHARE` of those on gpt-oss, whose attention
has a sink per head and whose experts are MXFP4; in `WINDOW_SHARE` of the others one whose layers attend
within sliding windows shorter than most prompts; in `VISION_SHARE` of the rest a
vision-language model, whose prompts hold images: random pixels, several per prompt, some in
prefixes prompts share, so their K/V is cached and reused; in `FUSED_SHARE` of the rest one
whose checkpoint fuses its projections, Phi-4-mini with longrope and partial rotary). In `STALE_START_SHARE` of workloads (drawn by a
generator of their own) the engine starts on another checkpoint of the same model
(`weight_checkpoints.perturbed_copy`), runs the whole workload there (caching its prefixes
with K/V of the wrong weights), then loads the model's weights
(`Engine.update_weights_from_disk`) before the workload that is checked: nothing the first
run left (cached prefixes, kept K/V, drafts) may show in the second. In `PRIORITY_SHARE`
of workloads (another generator of their own) the engine schedules by priority, with either
order and a preemption threshold of 0, 1 or 10, and the requests carry random priorities:
the admission order changes and running requests are preempted (retracted) for others,
and nothing of it may show in any request's output. In `PAUSE_SHARE` of workloads
(likewise) generation pauses once or twice for a few steps (`Scheduler.pause`: every
running request retracted, or kept in place with its K/V) while arrivals and aborts go
on, then continues.

Checked for every request: its output ids equal the same request run alone on a fresh
engine, its finish reason too, and its logprobs (output, top and input) agree within
`LOGPROB_TOL` (with an int8 KV cache, within what the cache's rounding itself moves that
sequence's logprobs: `Reference.kv_rounding_effect`); an aborted request's output is a
prefix of the alone run's; an embedding agrees within `EMBED_TOL`. Each token of
the alone run is what sprig's sampler picks from transformers' logits for the same
context (greedy: the argmax; seeded: the same seeded draw), its logits masked by the
request's grammar (a fresh matcher fed the run's tokens; a token the grammar forces, which
jump-forward may have placed unsampled, need only be allowed; a regex llguidance compiled
is fed to outlines' matcher too, and the two must allow the same tokens at every step);
with an int8 KV cache the alone run uses one too, and transformers rounds its K/V by the
same rule
(`hf_kv_quant`); with int4 weights (online RTN) both carry the same quantized weights,
transformers as their dequantized floats (`quant_checkpoints.with_rtn_weights`). Two float
paths can round a
near-tie either way, so a difference is accepted only where the reference decision itself
flips when the two tokens' logits move `TIE_MARGIN` towards each other; such ties are
counted. After every workload the KV accounting is exact and the engine idle.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from draft_checkpoints import truncated_draft
from hf_kv_quant import hf_model
from lora_adapters import fused_targets, peft_adapter
from peft import PeftModel
from quant_checkpoints import with_rtn_weights
from vision_checkpoint import random_image
from weight_checkpoints import perturbed_copy

from sprig.kernels.logit_mask import unpack_bitmask
from sprig.runtime import Engine
from sprig.runtime.constrained import (
    FreeGrammar,
    Grammar,
    RoutedBackend,
    bitmask_width,
    spec_from_params,
)
from sprig.runtime.constrained.regex_text import lark_grammar
from sprig.runtime.model_config import ImageSpec, ModelConfig
from sprig.runtime.multimodal.prompts import image_runs
from sprig.runtime.quantization.formats import OnlineFormat
from sprig.runtime.request_contract import (
    LogprobOptions,
    build_embedding_requests,
    build_requests,
)
from sprig.runtime.sampling import SamplingBatch, SamplingParams, sample
from sprig.runtime.scheduler.marker import Marker
from sprig.runtime.scheduler.reasoning_gate import Markers, ReasoningGate
from sprig.runtime.scheduler.request import Req
from sprig.runtime.scheduler.trigger_gate import TriggerGate
from sprig.runtime.speculative.drafter import ContextDrafts
from sprig.runtime.speculative.ngram import NgramDrafter

LOGPROB_TOL = 1e-5
# an embedding (a unit vector) batched vs alone, per component: float32 rounding of other
# batch shapes; under the int8 KV cache, a K/V value rounded to the other side of an int8
# step (a step is 1/127 of its token-head's largest value) moves it further
EMBED_TOL = {"auto": 1e-5, "int8": 1e-3}
EMBED_SHARE = 0.1
STALE_START_SHARE = 0.15
PAUSE_SHARE = 0.2  # of workloads, those whose generation pauses (retracted or in place) and continues mid-run
PRIORITY_SHARE = 0.25  # of workloads, those scheduled by priority (some requests preempting others)
LORA_SHARE = 0.15  # of workloads (neither int4 nor tensor-parallel), those serving LoRA adapters
LORA_NAMES = ("a", "b")  # `fuzz_adapters`' adapters
MOE_SHARE = 0.2  # of workloads, those on a mixture-of-experts model (where the fuzzer is given one)
SINK_SHARE = 0.4  # of those, the ones on a model with attention sinks, gpt-oss (where given one)
WINDOW_SHARE = 0.2  # of the others, those on a model with sliding-window layers (where given one)
VISION_SHARE = 0.15  # of the rest, those on a vision-language model, with images (where given one)
FUSED_SHARE = 0.15  # of the rest, those on a model whose checkpoint fuses its projections, Phi-3 (where given one)
IMAGE_SHARE = 0.5  # of a vision workload's prompts and shared prefixes, those holding an image (or two)
TIE_MARGIN = 1e-3
STOP_STRINGS = ["e", "a", "t", " the", ".", "o"]
SPECIAL_NAMES = r"([a-z]{1,3}<s>|[0-9]{1,3}</s>)[a-z ]{0,6}"  # special tokens' names (the EOS's too), whole, as text
REGEXES = [r"[a-z ]{1,24}", r"( ?[a-z]{1,5}){1,6}\.?", r"[0-9a-f]{2,12}( [0-9a-f]{2,4})*", SPECIAL_NAMES]
TRIGGERS = ["e", " t", "a"]
THINKING_SHARE = 0.3  # of constrained requests, those whose constraint waits for a reasoning end marker
BUDGET_SHARE = 0.15  # of unconstrained requests, those whose reasoning a thinking budget closes
# half of the markers are a special token of the tiny tokenizers, as reasoning models' are
# (`</think>`), half plain text, which a token may complete and run on past (the mask must
# refuse such a token when the grammar refuses what follows the marker in it)
THINKING_END, THINKING_END_ID, THINKING_BIAS = "<|end|>", 3, 4.0  # biased so that outputs reach it
THINKING_TEXT_ENDS = ["e", " t", "an"]
THINKING_START = "<s>"  # a start marker the output may open with
THINKING_EXIT = "</s>"  # their EOS: an exit when it is a stop token of the request
FIRST_ORDINARY_ID = 4  # the tiny tokenizers' special tokens come first
# engine options that change the model's numbers: alone runs and transformers take the workload's
NUMERICS = ("kv_cache_dtype", "quantization", "quantization_group_size")
# and what compiles regexes (the same outputs either way, masked by other code): alone runs and
# transformers' masks take the workload's too; and the LoRA adapter slots (their number
# sets the width the adapters' matmuls sum over): alone runs take the workload's
REFERENCE_OPTIONS = (*NUMERICS, "grammar_backend", "max_loras_per_batch")
REFERENCE_POOL = 4096  # the alone runs' KV tokens: every request fits a workload's loose pool of 4096 (on CUDA the default is most of the GPU)
GUIDED_SHARE = 0.3  # of workloads, those whose regexes llguidance compiles (`grammar_backend`)
ReferenceKey = tuple[tuple[str, Any], ...]  # a workload's `REFERENCE_OPTIONS` that are not the default


def reference_key(options: dict[str, Any]) -> ReferenceKey:
    """The workload's options its references take (`REFERENCE_OPTIONS`), where not the
    default."""
    return tuple(sorted((k, v) for k, v in options.items()
                        if k in REFERENCE_OPTIONS and v not in (None, "auto", "outlines")))


@dataclass(frozen=True)
class Request:
    """One request of a workload: added at step `arrival`, aborted at step `abort_at`."""

    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] = ()
    arrival: int = 0
    abort_at: int | None = None
    embed: bool = False  # an embedding request (its params unused): its prompt's embedding
    priority: int | None = None  # sent only where the workload's engine schedules by priority
    lora: str | None = None  # the LoRA adapter it runs with (`fuzz_adapters`' names), in LoRA workloads
    images: tuple[int, ...] = ()  # the seeds of its prompt's images (`random_image`), in prompt order

    @property
    def checked(self) -> bool:
        """Whether its outputs are reproducible: greedy, seeded or an embedding."""
        return self.embed or self.params.is_greedy or self.params.seed is not None


@dataclass(frozen=True)
class Pause:
    """`Scheduler.pause(mode)` before step `at`, `resume` before step `at + steps` (arrivals
    and aborts go on meanwhile)."""

    at: int
    mode: str  # "retract" or "in_place": neither changes a request's tokens
    steps: int


@dataclass(frozen=True)
class Workload:
    seed: int
    model: str  # key into the fuzzer's models
    requests: tuple[Request, ...]
    options: dict[str, Any]  # Engine keywords
    perturbed_trees: bool = False  # drafts from `PerturbedTrees` instead of the ngram drafter's
    stale_start: bool = False  # first run on other weights, then loads the model's (`STALE_START_SHARE`)
    pauses: tuple[Pause, ...] = ()  # generation paused mid-run (`PAUSE_SHARE`)

    def describe(self) -> str:
        return (
            f"workload seed {self.seed} on {self.model}: {len(self.requests)} requests, "
            f"engine {self.options}{', drafts from PerturbedTrees' if self.perturbed_trees else ''}"
            f"{', after a run on other weights and an update' if self.stale_start else ''}"
            f"{f', pauses {self.pauses}' if self.pauses else ''}"
        )


class PerturbedTrees:
    """A context drafter for the fuzzer that knows what each checked request will emit
    (its alone run, `runs`: prompt + output ids) and proposes token trees the target
    leaves the draft of: the known continuation of the context (else prompt lookup's, over
    unigrams and up), half of the time with one token swapped for a recent token of the
    context and cut after it; as alternatives the other known continuations (samples of
    one prompt), the unswapped one, prompt lookup's, and more swaps. So every walk over a
    tree (leaving the draft, following an alternative) and every adoption of an
    alternative's slots happens. Not pure (the swaps are random): what it proposes never
    changes a request's tokens, only how many passes they take."""

    def __init__(self, runs: list[list[int]], seed: int) -> None:
        self.runs = runs
        self.rng = random.Random(seed)
        self.lookup = NgramDrafter(max_ngram=3, min_ngram=1)

    def _known(self, context, k: int) -> list[list[int]]:
        ctx, n, out = list(context), len(context), []
        for run in self.runs:
            path = run[n : n + k]
            if path and run[:n] == ctx and path not in out:
                out.append(path)
        return out or [p for p in [self.lookup.propose(context, k)] if p]

    def _swap(self, path: list[int], context) -> list[int]:
        j = self.rng.randrange(len(path))
        return [*path[:j], self.rng.choice(list(context[-16:])), *path[j + 1 :]][: self.rng.randint(j + 1, len(path))]

    def propose(self, context, k: int) -> list[int]:
        known = self._known(context, k)
        if not known:
            return []
        return self._swap(known[0], context) if self.rng.random() < 0.5 else known[0]

    def alternatives(self, context, k: int, width: int) -> list[list[int]]:
        known = self._known(context, k)
        out = [*known, *self.lookup.alternatives(context, k, width), *(self._swap(p, context) for p in known)]
        return [p for i, p in enumerate(out) if p not in out[:i]][:width]


@dataclass
class Outcome:
    """What one sequence produced, and the params it ran with (sample j of n: seed + j)."""

    params: SamplingParams
    ids: list[int]
    finish: dict[str, Any] | None
    logprobs: list[float]
    top: list[list[tuple[float, int]]]
    input_logprobs: list[tuple[float | None, int]]
    input_top: list[list[tuple[float, int]] | None]
    picked: list[list[tuple[float, int]]]  # token_ids_logprob's, per output position
    input_picked: list[list[tuple[float, int]] | None]
    embedding: list[float] | None
    drafts_kept: int  # speculative drafts its tokens took

    @staticmethod
    def of(req: Req) -> Outcome:
        return Outcome(
            req.params, list(req.output_ids), req.finish.to_json() if req.finish else None,
            [lp for lp, _ in req.output_logprobs], [list(row) for row in req.output_top_logprobs],
            list(req.input_logprobs), list(req.input_top_logprobs),
            [list(row) for row in req.output_token_ids_logprobs], list(req.input_token_ids_logprobs),
            req.embedding, sum(k * n for k, n in enumerate(req.spec_accept_histogram)),
        )

    @property
    def aborted(self) -> bool:
        return self.finish is not None and self.finish["type"] == "abort"


@dataclass
class Stats:
    workloads: int = 0
    requests: int = 0  # sequences compared with their alone runs
    tokens: int = 0  # output tokens compared
    aborted: int = 0
    retractions: int = 0
    ties: int = 0  # near-ties rounded differently (batched vs alone, or sprig vs transformers)
    hf_tokens: int = 0  # tokens checked against transformers' logits
    constrained: int = 0  # of the sequences, those under a regex (from the start or a trigger)
    context_free: int = 0  # of those, the ones whose regex went to llguidance as a Lark grammar
    guided: int = 0  # of those, the ones whose regex llguidance compiled itself (`grammar_backend`)
    thinking: int = 0  # of those, the ones whose constraint waited for a reasoning end marker
    budgeted: int = 0  # of the sequences, those whose reasoning a thinking budget held (constrained or not)
    gated_drafts: int = 0  # speculative drafts kept by sequences under a grammar (a constraint or a budget)
    picked: int = 0  # of the sequences, those whose token_ids_logprob entries were compared
    embeddings: int = 0  # embedding requests compared with their alone runs
    embed_diff: dict[str, float] = field(default_factory=dict)  # the largest difference, by KV cache dtype
    by_backend: dict[str, int] = field(default_factory=dict)
    by_kv_cache: dict[str, int] = field(default_factory=dict)  # workloads by kv_cache_dtype
    by_weights: dict[str, int] = field(default_factory=dict)  # workloads by weight quantization
    by_spec: dict[str, int] = field(default_factory=dict)  # workloads by speculative drafter
    by_tp: dict[str, int] = field(default_factory=dict)  # workloads by tensor-parallel ranks
    by_model: dict[str, int] = field(default_factory=dict)  # workloads by model
    alternatives: int = 0  # alternative paths of token trees verified (the ngram and radix drafters')
    alternatives_kept: int = 0  # of them, those the kept tokens lay on
    weight_updates: int = 0  # workloads run after a run on other weights and a weight update
    preemptions: int = 0  # running requests retracted for waiting ones of higher priority
    lora: int = 0  # sequences run with a LoRA adapter (checked against PEFT's model)
    images: int = 0  # sequences whose prompts held images (checked against transformers with their pixels)
    pauses: int = 0  # generation paused and continued mid-run (retracting the requests or keeping them in place)

    def line(self) -> str:
        kinds = {**self.by_backend, **self.by_kv_cache, **self.by_weights, **self.by_tp, **self.by_spec,
                 **self.by_model}
        backends = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        return (
            f"{self.workloads} workloads ({backends}), {self.requests} requests, {self.tokens} tokens "
            f"compared with their alone runs, {self.hf_tokens} with transformers; {self.constrained} of the "
            f"requests constrained ({self.context_free} by llguidance as Lark, {self.guided} as regexes, "
            f"{self.thinking} after a reasoning marker); {self.budgeted} with a thinking budget; "
            f"{self.gated_drafts} drafts kept by constrained or budgeted requests; "
            f"{self.picked} with token_ids_logprob; {self.embeddings} embeddings (largest difference "
            f"{', '.join(f'{k} {v:.1e}' for k, v in sorted(self.embed_diff.items())) or 'none'}); {self.aborted} aborted, "
            f"{self.retractions} retractions, {self.ties} near-ties; token trees: {self.alternatives} "
            f"alternative paths verified, {self.alternatives_kept} followed; {self.weight_updates} after a weight update; "
            f"{self.preemptions} preemptions by priority; {self.lora} with a LoRA adapter; {self.images} with images; "
            f"{self.pauses} pauses"
        )


# ---------------------------------------------------------------- workloads


def make_workload(
    seed: int, model: str, vocab: int, *, triton: bool, int4_share: float = 0.25, tp_share: float = 0.0,
    image: ImageSpec | None = None,
) -> Workload:
    """A random workload and engine config, a function of `seed` alone (and of the shares
    of workloads with int4 weights and with two tensor-parallel ranks). For a model that
    takes images (`image`), prompts and shared prefixes hold images (`IMAGE_SHARE`; their
    own generator), and what sprig does not combine with images is not drawn: int4
    weights, the draft-model drafter (radix instead), embedding requests with images."""
    rng, constraints = random.Random(seed), random.Random(f"constraints {seed}")
    thinking = random.Random(f"thinking {seed}")
    budgets = random.Random(f"thinking budget {seed}")
    pictures = random.Random(f"images {seed}")
    if image is not None:
        int4_share = 0.0
        vocab = min(vocab, image.token_id, image.begin_id, image.end_id)  # random ids never an image's

    def ids(n: int) -> list[int]:
        out = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]
        if image is not None and pictures.random() < IMAGE_SHARE:
            for _ in range(pictures.choice([1, 1, 2])):
                at = pictures.randint(0, len(out))
                out[at:at] = [-1 - pictures.randrange(10_000)]  # an image of that seed (`_expanded`)
        return out

    small = triton  # the Triton interpreter is slow: fewer, shorter requests
    prefixes = [ids(rng.randint(8, 24 if small else 70)) for _ in range(rng.randint(0, 3))]
    prompts: list[list[int]] = []
    for _ in range(rng.randint(1, 4 if small else 10)):
        if prompts and rng.random() < 0.15:
            prompts.append(list(rng.choice(prompts)))  # the same prompt twice
        else:
            head = rng.choice(prefixes) if prefixes and rng.random() < 0.7 else []
            prompts.append(head + ids(rng.randint(1, 8 if small else 30)))
    requests = []
    picks = random.Random(f"token_ids_logprob {seed}")  # apart from `rng`: older seeds replay unchanged
    embeds = random.Random(f"embed {seed}")  # likewise
    for i, marked in enumerate(prompts):
        prompt, seeds = _expanded(marked, image)
        params = _params(rng, constraints, thinking, budgets, vocab, small)
        logprob = rng.random() < 0.3
        picked = tuple(picks.sample(range(vocab), picks.randint(1, 4))) if logprob and picks.random() < 0.5 else ()
        requests.append(Request(
            rid=f"r{i}",
            prompt=tuple(prompt),
            params=params,
            return_logprob=logprob,
            logprob_start_len=rng.choice([-1, 0, rng.randrange(len(prompt))]) if logprob else -1,
            top_logprobs_num=rng.choice([0, 0, 1, 3]) if logprob else 0,
            token_ids_logprob=picked,
            arrival=rng.choice([0, 0, rng.randint(0, 12)]),
            abort_at=rng.randint(0, 16) if rng.random() < 0.1 else None,
            embed=embeds.random() < EMBED_SHARE and not seeds,
            images=seeds,
        ))
    options = _options(rng, requests, triton, int4_share, tp_share)
    if constraints.random() < GUIDED_SHARE:  # its own generator, as the requests' constraints
        options["grammar_backend"] = "llguidance"
    ranks = random.Random(f"priority {seed}")  # likewise
    if ranks.random() < PRIORITY_SHARE:
        options["enable_priority_scheduling"] = True
        options["schedule_low_priority_values_first"] = ranks.random() < 0.5
        options["priority_scheduling_preemption_threshold"] = ranks.choice([0, 1, 10])
        requests = [replace(r, priority=ranks.choice([None, 0, 1, 5, 20, -3])) for r in requests]
    adapters = random.Random(f"lora {seed}")  # likewise
    if adapters.random() < LORA_SHARE and "quantization" not in options:
        options["max_loras_per_batch"] = adapters.choice([2, 3, 8])  # `run_one` adds the adapters' paths
        requests = [replace(r, lora=adapters.choice([None, *LORA_NAMES])) for r in requests]
    if image is not None and options.get("speculative_algorithm") == "draft":
        options["speculative_algorithm"] = "radix"
        options.pop("disable_draft_decoder", None)
        options["speculative_alternatives"] = 0
    trees = options.get("speculative_algorithm") == "ngram" and options["speculative_alternatives"] > 0
    perturbed = trees and rng.random() < 0.5
    if options.get("speculative_algorithm") == "ngram" and not trees:  # known drafts, no trees: their own generator
        perturbed = random.Random(f"known drafts {seed}").random() < 0.5
    pausing = random.Random(f"pauses {seed}")  # likewise
    pauses = (tuple(Pause(pausing.randint(0, 12), pausing.choice(["retract", "in_place"]), pausing.randint(1, 3))
                    for _ in range(pausing.randint(1, 2)))
              if pausing.random() < PAUSE_SHARE else ())
    return Workload(seed, model, tuple(requests), options, perturbed_trees=perturbed,
                    stale_start=random.Random(f"weights {seed}").random() < STALE_START_SHARE, pauses=pauses)


def _expanded(marked: list[int], image: ImageSpec | None) -> tuple[list[int], tuple[int, ...]]:
    """A prompt whose images are marked by -1 - seed: each becomes its begin token, the
    image tokens and its end token; and the images' seeds, in order."""
    if image is None:
        return marked, ()
    out: list[int] = []
    for t in marked:
        out.extend((image.begin_id, *[image.token_id] * image.tokens_per_image, image.end_id) if t < 0 else (t,))
    return out, tuple(-1 - t for t in marked if t < 0)


def _params(rng: random.Random, constraints: random.Random, thinking: random.Random, budgets: random.Random,
            vocab: int, small: bool) -> SamplingParams:
    kind = rng.choices(["greedy", "seeded", "unseeded"], [0.5, 0.4, 0.1])[0]
    p: dict[str, Any] = {"max_new_tokens": rng.choice([0, *range(1, 8 if small else 24)])}
    if kind != "greedy":
        p["temperature"] = rng.uniform(0.5, 1.5)
        p["top_p"] = rng.choice([1.0, rng.uniform(0.5, 1.0)])
        p["top_k"] = rng.choice([-1, rng.randint(2, 50)])
        p["min_p"] = rng.choice([0.0, 0.0, rng.uniform(0.01, 0.2)])
        if kind == "seeded":
            p["seed"] = rng.randrange(2**32)
            p["n"] = rng.choice([1, 1, 1, 2, 3])
    else:
        p["temperature"] = 0.0
    if rng.random() < 0.2:
        p["frequency_penalty"] = rng.uniform(-0.5, 1.0)
        p["presence_penalty"] = rng.uniform(-0.5, 1.0)
    if rng.random() < 0.2:
        p["repetition_penalty"] = rng.uniform(0.8, 1.5)
    if rng.random() < 0.2:
        p["logit_bias"] = {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}
    if rng.random() < 0.3:
        p["stop_token_ids"] = rng.sample(range(vocab), rng.randint(1, max(2, vocab // 10)))
    if rng.random() < 0.2:
        p["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
    p["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.15:
        p["min_new_tokens"] = rng.randint(0, p["max_new_tokens"])
    if constraints.random() < 0.2:  # its own generator: the workload's other draws do not depend on it
        p["regex"] = constraints.choice(REGEXES)
        if p["regex"] == SPECIAL_NAMES:  # a stop token among its forced characters would leave no token
            p.pop("stop_token_ids", None)
        if constraints.random() < 0.5:
            p["constraint_trigger"] = constraints.choice(TRIGGERS)
        if constraints.random() < 0.4:  # as the server sends tools' grammars: a Lark grammar, to llguidance
            p["ebnf"] = lark_grammar(p.pop("regex"))
        p.pop("min_new_tokens", None)  # it may forbid the only token a grammar allows
        if thinking.random() < THINKING_SHARE:  # its own generator: older seeds' draws are unchanged
            p["reasoning_end"] = THINKING_END
            p["logit_bias"] = {**p.get("logit_bias", {}), THINKING_END_ID: THINKING_BIAS}
            if thinking.random() < 0.5:
                p["reasoning_start"] = THINKING_START
            if thinking.random() < 0.5:
                p["reasoning_exits"] = [THINKING_EXIT]
            if thinking.random() < 0.5:
                p["reasoning_end"] = thinking.choice(THINKING_TEXT_ENDS)
            if budgets.random() < 0.5:
                p["thinking_budget"] = budgets.randint(0, 6)
    elif budgets.random() < BUDGET_SHARE:  # no bias towards the end marker: the budget closes most of them
        p["reasoning_end"] = budgets.choice([THINKING_END, *THINKING_TEXT_ENDS])
        if budgets.random() < 0.5:
            p["reasoning_start"] = THINKING_START
        p["thinking_budget"] = budgets.randint(0, p["max_new_tokens"])
        p.pop("min_new_tokens", None)  # it may forbid the marker's token, if a stop token is one of them
    return SamplingParams.from_dict(p)


def _options(
    rng: random.Random, requests: list[Request], triton: bool, int4_share: float, tp_share: float
) -> dict[str, Any]:
    page = rng.choice([1, 1, 4, 16])
    need = max(-(-(len(r.prompt) + r.params.max_new_tokens) // page) * page for r in requests)
    tight = rng.random() < 0.35
    options: dict[str, Any] = {
        "attention_backend": "triton" if triton else "torch",
        "page_size": page,
        "max_total_tokens": need + page * rng.randint(0, 6) if tight else 4096,
        "chunked_prefill_size": rng.choice([None, 4, 8, 16, 64]),
        "max_prefill_tokens": rng.choice([16, 64, 8192]),
        "max_running_requests": rng.choice([1, 2, 3, 8, 64]),
        "disable_radix_cache": rng.random() < 0.25,
        "schedule_policy": rng.choice(["fcfs", "lpm", "dfs-weight"]),
        "in_batch_prefix_min": rng.choice([1, 4, 32]),
    }
    if tight:
        options["new_token_ratio"] = options["min_new_token_ratio"] = 0.0
    if options["chunked_prefill_size"] is not None:
        options["max_prefill_tokens"] = max(options["max_prefill_tokens"], options["chunked_prefill_size"])
    options["kv_cache_dtype"] = rng.choice(["auto", "auto", "int8"])
    if rng.random() < int4_share:  # drawn last: the options above do not depend on the share
        options["quantization"] = "int4"
        options["quantization_group_size"] = rng.choice([32, 64])
    # not with int4: groups of 64 do not tile a rank's 32 inputs of the tiny models' o_proj
    if tp_share and "quantization" not in options and rng.random() < tp_share:
        options["tp_size"] = 2  # the batched run on two ranks over gloo; the alone runs on one
    if rng.random() < 0.3:  # drawn last: the draws above do not depend on it
        options["speculative_algorithm"] = rng.choice(["ngram", "radix", "draft"])
        options["speculative_num_draft_tokens"] = rng.choice([1, 2, 4, 8])
        # always draft, or costs under which some steps draft and some do not (never measured: replayable)
        options["speculative_pass_costs"] = rng.choice(["1,0,0,0,0,0,0", "1,0,0,0,0,0,0", "2,0.05,2,0.02,0.05,1,0.05",
                                                        "1,0.01,3,0.1,0.1,2,0.1"])
        if options["speculative_algorithm"] == "draft" and rng.random() < 0.5:
            options["disable_draft_decoder"] = True  # the rounds CUDA runs: the runner's decode steps
        if options["speculative_algorithm"] != "draft":
            options["speculative_alternatives"] = rng.choice([0, 1, 3, 3])  # token trees of up to 4 paths
    return options


# ---------------------------------------------------------------- running


def drive(engine: Engine, requests: tuple[Request, ...], pauses: tuple[Pause, ...] = ()) -> dict[str, Outcome]:
    """Run `requests` through the engine's scheduler step by step (arrivals and aborts at
    their steps, generation paused and continued as `pauses` say); returns each
    sequence's outcome by rid (`{rid}-{j}` for n > 1)."""
    sched = engine.scheduler
    limits = engine.limits
    reqs: dict[str, Req] = {}
    aborts: dict[int, list[str]] = {}
    last_arrival = max(r.arrival for r in requests)
    # far more steps than any schedule needs (each step computes at least one token of
    # some request, unless paused): a workload past it is stuck
    limit = (last_arrival + 100 + sum(p.steps for p in pauses)
             + 20 * sum((len(r.prompt) + r.params.max_new_tokens) * r.params.n for r in requests))
    step = 0
    while step <= last_arrival or sched.has_work or sched.paused:
        for p in pauses:
            if p.at == step:
                sched.pause(p.mode)
            if p.at + p.steps == step:
                sched.resume()
        for r in requests:
            if r.arrival != step:
                continue
            logprobs = LogprobOptions(r.return_logprob, r.logprob_start_len, r.top_logprobs_num,
                                      token_ids_logprob=r.token_ids_logprob)
            priority = r.priority if sched.config.enable_priority_scheduling else None
            seqs = (build_embedding_requests([list(r.prompt)], limits, rid=r.rid, new_rid=str, lora_path=r.lora)
                    if r.embed else
                    build_requests([list(r.prompt)], r.params, limits, rid=r.rid, new_rid=str, logprobs=logprobs,
                                   priority=priority, lora_path=r.lora, images=[_images(engine, r)]))
            for seq in seqs:
                req = Req.of(seq)
                sched.add_request(req)
                reqs[seq.rid] = req
                if r.abort_at is not None:
                    aborts.setdefault(step + r.abort_at, []).append(seq.rid)
        for rid in aborts.pop(step, []):
            sched.abort(rid)
        sched.step()
        step += 1
        if step > limit:
            raise AssertionError(
                f"no end after {limit} steps: running {[r.rid for r in sched.running]}, waiting "
                f"{[r.rid for r in sched.waiting]}, chunked {sched.chunked and sched.chunked.rid}, "
                f"{sched.stats.retractions} retractions"
            )
    assert not sched.waiting and not sched.running and sched.chunked is None
    sched.check_integrity()
    kv = sched.kv
    assert kv.allocator.available() + kv.cache.evictable_size() == kv.allocator.size
    assert kv.cache.protected_size() == 0 and kv.table.available() == kv.table.size
    if sched.speculative is not None:
        for req in reqs.values():
            _check_spec_counts(req)
    return {rid: Outcome.of(req) for rid, req in reqs.items()}


def _images(engine: Engine, request: Request) -> tuple:
    """The request's processed images (`ImageInput`s over its prompt's image runs)."""
    if not request.images:
        return ()
    return engine.images.images(list(request.prompt), [random_image(s) for s in request.images])


def _check_spec_counts(req: Req) -> None:
    """With speculation on, a request's counts (what `meta_info` reports) agree with its
    tokens: every decode step it took part in is a pass that emitted the drafts it kept and
    one token of the target's (the last may end on a kept draft), each prefill that
    completed emitted one (the first, and at most one after each retraction), and
    jump-forward tokens took no pass."""
    hist = req.spec_accept_histogram
    passes, kept = sum(hist), sum(k * n for k, n in enumerate(hist))
    decoded = len(req.output_ids) - req.jump_forward_tokens
    counts = f"request {req.rid}: {decoded} tokens decoded, passes by drafts kept {hist}, {req.spec_drafted} drafted"
    assert kept <= req.spec_drafted, counts
    assert (not passes or passes + kept <= decoded) and decoded <= passes + kept + 1 + req.retractions, counts


class Reference:
    """One model's references, for each `ReferenceKey` (KV cache dtype, weight quantization,
    grammar backend) a workload runs with: an engine for alone runs (default settings
    otherwise, shadow mode, its cache flushed before each run), transformers (its K/V
    rounded as that cache stores them, its weights the quantized ones) and grammar
    matchers to mask its logits; made when first needed. Its engines, and the workloads'
    run against it, run on `device` (transformers on the CPU)."""

    def __init__(self, path: Path, device: str = "cpu") -> None:
        self.path, self.device = path, device
        self.engines: dict[ReferenceKey, Engine] = {}
        self.hf: dict[ReferenceKey, torch.nn.Module] = {}
        engine = self.engine(())
        self.vocab = engine.runner.model_config.vocab_size
        self.eos_ids = engine.scheduler.eos_ids
        self.tokenizer = engine.tokenizer
        self.image = engine.images.spec if engine.images is not None else None
        self._grammars: dict[str, RoutedBackend] = {}  # by grammar_backend

    def engine(self, key: ReferenceKey) -> Engine:
        if key not in self.engines:
            self.engines[key] = Engine(str(self.path), dtype="float32", device=self.device, max_total_tokens=REFERENCE_POOL,
                                       shadow_attention=True, check_integrity=True, **lora_options(self.path, key))
        return self.engines[key]

    def alone(self, request: Request, key: ReferenceKey) -> dict[str, Outcome]:
        engine = self.engine(key)
        engine.flush_cache()
        return drive(engine, (replace(request, arrival=0, abort_at=None),))

    def logits(self, ids: list[int], key: ReferenceKey, lora: str | None = None,
               images: tuple[int, ...] = ()) -> torch.Tensor:  # [len(ids), V] f32
        """transformers' logits (with PEFT's adapter `lora` of `fuzz_adapters`, if given;
        with the images of seeds `images` over the image runs of `ids`, their blocks
        attending bidirectionally: transformers' `token_type_ids`)."""
        key = tuple(kv for kv in key if kv[0] in NUMERICS)
        if (key, lora) not in self.hf:
            options = dict(key)
            hf = hf_model(self.path, options.get("kv_cache_dtype", "auto"))
            if "quantization" in options:
                fmt = OnlineFormat.of(options["quantization"], options["quantization_group_size"])
                hf = with_rtn_weights(hf, fmt.scheme)
            if lora is not None:
                hf = PeftModel.from_pretrained(hf, fuzz_adapters(self.path)[lora]).eval()
            self.hf[key, lora] = hf
        hf = self.hf[key, lora]
        with torch.inference_mode():
            if not images:
                return hf(torch.tensor([ids])).logits[0].float()
            return hf(**self._image_inputs(hf, ids, images)).logits[0].float()

    def _image_inputs(self, hf: torch.nn.Module, ids: list[int], images: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """transformers' inputs for `ids` whose first image runs hold the images of seeds
        `images` (the prompt's): their embeddings scattered over those runs alone and their
        tokens marked as image blocks (`token_type_ids`). An image token the model
        generated later is a token like any other, as sprig feeds it (transformers' own
        scatter would count it as a placeholder)."""
        runs = image_runs(ids, self.image.token_id)[: len(images)]
        prompt = ids[: runs[-1][0] + runs[-1][1]]
        pixels = [im.tensor() for im in self.engine(()).images.images(prompt, [random_image(s) for s in images])]
        features = hf.model.get_image_features(torch.stack(pixels)).pooler_output  # [N, tokens, H]
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))
        types = torch.zeros(1, len(ids), dtype=torch.long)
        for (start, n), image in zip(runs, features, strict=True):
            embeds[0, start : start + n] = image.to(embeds.dtype)
            types[0, start : start + n] = 1
        return {"inputs_embeds": embeds, "token_type_ids": types}

    def kv_rounding_effect(self, ids: list[int], key: ReferenceKey, rounded: torch.Tensor, top: int = 0,
                           also: tuple[int, ...] = (), lora: str | None = None, images: tuple[int, ...] = ()) -> float:
        """The most the int8 KV cache's rounding moves a logprob of `ids`, of the tokens
        `also` at each position (where token_ids_logprob's are compared), or with `top`
        of any of the `top + 1` likeliest tokens at each position too (where top logprobs
        are compared: the rounding can move another token's logprob several times as far
        as the sampled one's, 1.2e-2 against 2.2e-3 at fuzz seed 60980): transformers'
        logits with the cache's rounding (`rounded`, `self.logits(ids, key)`) vs without.
        The tolerance between a batched and an alone run.

        Their ~1e-6 float differences (chunks and batches reduce in different orders) can
        tip a K/V element across a rounding boundary: one element moves one step, where the
        rounding moves every element up to half a step. Measured on 1,276 int8 sequences
        (seeds 20000-20567, tiny and sharp models): a tipped element moved a logprob by at
        most 0.05 of this bound (5.9e-4 against 1.2e-2). At seed 60980 a top logprob moved
        3.4e-3: 0.28 of the bound over the likeliest tokens, 1.5 times the sampled tokens'
        bound, which was the top logprobs' tolerance before. A request reading another's
        rows moves them by far more."""
        if len(ids) < 2:
            return 0.0
        float_key = tuple(kv for kv in key if kv[0] != "kv_cache_dtype")
        with_rounding, exact = (torch.log_softmax(logits[:-1], -1)
                                for logits in (rounded, self.logits(ids, float_key, lora, images)))
        compared = torch.tensor(ids[1:])[:, None]
        if also:
            compared = torch.cat([compared, torch.tensor(also).expand(len(ids) - 1, -1)], 1)
        if top:
            compared = torch.cat([compared, with_rounding.topk(min(top + 1, with_rounding.shape[-1]), -1).indices], 1)
        return (with_rounding.gather(1, compared) - exact.gather(1, compared)).abs().max().item()

    def grammar(self, params: SamplingParams, key: ReferenceKey) -> Grammar | None:
        """A fresh matcher of the request's constraint, as the scheduler of an engine with
        options `key` makes one."""
        spec = spec_from_params(params)
        if spec is None and params.thinking_budget is not None:  # the budget alone: a gate over no constraint
            markers = Markers.build(self.tokenizer, params.reasoning_start, params.reasoning_end)
            return ReasoningGate(FreeGrammar(), markers, opens_inside=params.reasoning_start is None,
                                 stop_token_ids=(), tokenizer=self.tokenizer, budget=params.thinking_budget)
        if spec is None:
            return None
        regular = dict(key).get("grammar_backend", "outlines")
        if regular not in self._grammars:
            self._grammars[regular] = RoutedBackend.from_tokenizer(self.tokenizer, logits_width=self.vocab,
                                                                   regular=regular)
        backend = self._grammars[regular]
        stops = params.stop_token_set(self.eos_ids)
        grammar = backend.matcher(backend.prepare(backend.compile(spec)), stop_token_ids=stops)
        if params.constraint_trigger is not None:
            trigger = Marker.build(self.tokenizer, params.constraint_trigger)
            grammar = TriggerGate(grammar, trigger, stop_token_ids=stops, tokenizer=self.tokenizer)
        if params.reasoning_end is None:
            return grammar
        markers = Markers.build(self.tokenizer, params.reasoning_start, params.reasoning_end, params.reasoning_exits)
        return ReasoningGate(grammar, markers, opens_inside=params.reasoning_start is None, stop_token_ids=stops,
                             tokenizer=self.tokenizer, budget=params.thinking_budget)

    def masked(self, rows: torch.Tensor, params: SamplingParams, ids: list[int], where: str,
               key: ReferenceKey) -> list[bool]:
        """Mask `rows` [len(ids) + 1, V] in place by the request's grammar fed `ids` one by
        one; returns, per token, whether the grammar forced it (its text the only one)."""
        grammar = self.grammar(params, key)
        if grammar is None:
            return [False] * len(ids)
        # outlines' matcher of a regex llguidance compiled: another implementation of the same masks
        other = self.grammar(params, ()) if params.regex is not None and dict(key).get("grammar_backend") else None
        forced = []
        bits = torch.zeros(bitmask_width(rows.shape[-1]), dtype=torch.int32)
        other_bits = torch.zeros_like(bits)
        for i in range(len(ids) + 1):
            if grammar.is_finished():
                if i < len(ids):
                    raise Mismatch(f"{where}\nthe alone run goes on past the end of its grammar at token {i}: {ids}")
                break
            grammar.fill_bitmask(bits)
            allowed = unpack_bitmask(bits[None], rows.shape[-1])[0]  # [V] bool
            if other is not None:
                other.fill_bitmask(other_bits)
                differ = allowed != unpack_bitmask(other_bits[None], rows.shape[-1])[0]
                if differ.any():
                    raise Mismatch(f"{where}\nafter {i} tokens of the alone run {ids}, llguidance and outlines "
                                   f"allow different tokens: {differ.nonzero().flatten().tolist()[:10]}")
            rows[i].masked_fill_(~allowed, float("-inf"))
            if i == len(ids):
                break
            forced.append(grammar.forced_continuation() is not None)
            if not grammar.accept_token(ids[i]):
                raise Mismatch(f"{where}\ntoken {i} ({ids[i]}) of the alone run breaks its grammar: {ids}")
            if other is not None:
                other.accept_token(ids[i])  # it allowed what llguidance allowed
        return forced

    def decide(self, logits: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[list[int]]) -> list[int]:
        """sprig's sampler on `logits` [L, V]: row i continues `prompt + outputs[i]`."""
        batch = SamplingBatch.build(
            [params] * len(outputs), output_ids=outputs, prompt_ids=[prompt] * len(outputs),
            eos_ids=self.eos_ids, vocab_size=logits.shape[-1],
        )
        return sample(logits, batch, logprobs=False).next_ids.tolist()

    def near_tie(self, row: torch.Tensor, params: SamplingParams, prompt: list[int], out: list[int], a: int, b: int) -> bool:
        """Whether the decision between tokens a and b flips when their logits move
        `TIE_MARGIN` towards each other (either way)."""
        toward_b, toward_a = row.clone(), row.clone()
        toward_b[a] -= TIE_MARGIN
        toward_b[b] += TIE_MARGIN
        toward_a[a] += TIE_MARGIN
        toward_a[b] -= TIE_MARGIN
        picks = self.decide(torch.stack([toward_b, toward_a]), params, prompt, [out, out])
        return picks == [b, a]


# ---------------------------------------------------------------- checking


class Mismatch(AssertionError):
    pass


def check_workload(workload: Workload, got: dict[str, Outcome], ref: Reference, stats: Stats,
                   alone: dict[str, dict[str, Outcome]] | None = None) -> None:
    """Compare every checked sequence of `workload` with its alone run (from `alone` by
    request rid where it holds it) and transformers."""
    key = reference_key(workload.options)
    for request in workload.requests:
        if not request.checked:
            continue
        runs = (alone or {}).get(request.rid) or ref.alone(request, key)
        for rid, want in runs.items():
            where = f"{workload.describe()}\nrequest {rid}: {request}"
            if request.embed:
                _check_embedding(got[rid], want, stats, where, dict(key).get("kv_cache_dtype", "auto"))
            else:
                _check_sequence(request, got[rid], want, ref, stats, where, key)


def _check_embedding(got: Outcome, want: Outcome, stats: Stats, where: str, kv: str) -> None:
    """An embedding request ends after its prefill (or is aborted first, with none); its
    embedding is its alone run's within `EMBED_TOL`."""
    if want.embedding is None or want.ids or want.finish != {"type": "length", "length": 0}:
        raise Mismatch(f"{where}\nthe embedding request alone ended {want.finish} with {want.ids}")
    if got.aborted:
        if got.embedding is not None or got.ids:
            raise Mismatch(f"{where}\naborted, yet it reported {got.ids} and an embedding")
        stats.aborted += 1
        return
    if got.ids or got.finish != want.finish or got.embedding is None or len(got.embedding) != len(want.embedding):
        raise Mismatch(f"{where}\nbatched {got.finish} {got.ids}, alone {want.finish}")
    diff = max(abs(a - b) for a, b in zip(got.embedding, want.embedding, strict=True))
    if diff > EMBED_TOL[kv]:
        raise Mismatch(f"{where}\nthe embedding differs from the alone run's by {diff:.2e} (at most {EMBED_TOL[kv]})")
    stats.embed_diff[kv] = max(stats.embed_diff.get(kv, 0.0), diff)
    stats.embeddings += 1
    stats.requests += 1


def _check_sequence(
    request: Request, got: Outcome, want: Outcome, ref: Reference, stats: Stats, where: str, key: ReferenceKey
) -> None:
    if want.aborted:
        raise Mismatch(f"{where}\nthe request alone was aborted: {want.finish}")
    prompt = list(request.prompt)
    seq_params = want.params
    logits = ref.logits(prompt + want.ids, key, request.lora, request.images)  # after prompt + ids[:i], for each i
    rows = logits[len(prompt) - 1 :].clone()  # [len(want.ids) + 1, V], masked by a grammar below
    stats.ties += _check_against_transformers(rows, seq_params, prompt, want.ids, ref, where, key)
    stats.hf_tokens += len(want.ids)
    stats.lora += request.lora is not None
    stats.images += bool(request.images)
    stats.constrained += spec_from_params(seq_params) is not None
    stats.context_free += seq_params.ebnf is not None
    stats.guided += seq_params.regex is not None and ("grammar_backend", "llguidance") in key
    stats.thinking += seq_params.reasoning_end is not None and spec_from_params(seq_params) is not None
    stats.budgeted += seq_params.thinking_budget is not None
    if spec_from_params(seq_params) is not None or seq_params.thinking_budget is not None:
        stats.gated_drafts += got.drafts_kept
    n = _common_len(got.ids, want.ids)
    if n < len(got.ids) and n < len(want.ids):  # they part at token n
        if not ref.near_tie(rows[n], seq_params, prompt, want.ids[:n], want.ids[n], got.ids[n]):
            raise Mismatch(f"{where}\nbatched {got.ids}\nalone   {want.ids}\nthey part at token {n}")
        stats.ties += 1
    elif got.aborted:
        if n != len(got.ids):
            raise Mismatch(f"{where}\naborted with {got.ids}, not a prefix of the alone run's {want.ids}")
        stats.aborted += 1
    elif got.ids != want.ids or got.finish != want.finish:
        raise Mismatch(f"{where}\nbatched {got.ids} {got.finish}\nalone   {want.ids} {want.finish}")
    tol = tol_top = tol_picked = LOGPROB_TOL
    if ("kv_cache_dtype", "int8") in key:
        tol = max(tol, ref.kv_rounding_effect(prompt + want.ids, key, logits, lora=request.lora, images=request.images))
        if request.top_logprobs_num:
            tol_top = max(tol, ref.kv_rounding_effect(prompt + want.ids, key, logits, request.top_logprobs_num,
                                                      lora=request.lora, images=request.images))
        if request.token_ids_logprob:
            tol_picked = max(tol, ref.kv_rounding_effect(prompt + want.ids, key, logits,
                                                         also=request.token_ids_logprob, lora=request.lora,
                                                         images=request.images))
    _close(got.logprobs[:n], want.logprobs[:n], f"{where}\noutput logprobs", tol)
    for a, b in zip(got.top[:n], want.top[:n], strict=True):
        _close_top(a, b, f"{where}\noutput top logprobs", tol_top)
    _close_picked(got.picked[:n], want.picked[:n], request, f"{where}\noutput token_ids logprobs", tol_picked)
    if not got.aborted:
        assert [t for _, t in got.input_logprobs] == [t for _, t in want.input_logprobs], where
        _close([lp for lp, _ in got.input_logprobs], [lp for lp, _ in want.input_logprobs], f"{where}\ninput logprobs", tol)
        for a, b in zip(got.input_top, want.input_top, strict=True):
            assert (a is None) == (b is None), where
            if a is not None:
                _close_top(a, b, f"{where}\ninput top logprobs", tol_top)
        _close_picked(got.input_picked, want.input_picked, request, f"{where}\ninput token_ids logprobs", tol_picked)
    stats.requests += 1
    stats.tokens += n
    stats.picked += bool(request.token_ids_logprob)


def _check_against_transformers(
    rows: torch.Tensor, params: SamplingParams, prompt: list[int], ids: list[int], ref: Reference, where: str,
    key: ReferenceKey,
) -> int:
    """Every token of the alone run is sprig's sampler's pick from transformers' logits
    for its context (teacher-forced); returns the near-ties met."""
    if not ids:
        return 0
    forced = ref.masked(rows, params, ids, where, key)
    picks = ref.decide(rows[: len(ids)].clone(), params, prompt, [ids[:i] for i in range(len(ids))])
    ties = 0
    for i, (pick, token) in enumerate(zip(picks, ids, strict=True)):
        if pick == token or (forced[i] and rows[i, token] > float("-inf")):
            continue
        if not ref.near_tie(rows[i], params, prompt, ids[:i], token, pick):
            raise Mismatch(f"{where}\ntoken {i} of the alone run is {token}; from transformers' logits sprig picks {pick}")
        ties += 1
    return ties


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _close(got: list[float | None], want: list[float | None], what: str, tol: float) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} entries, alone {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if (a is None) != (b is None) or (a is not None and abs(a - b) > tol):
            raise Mismatch(f"{what}: entry {i} is {a}, alone {b}")


def _close_picked(got: list[list[tuple[float, int]] | None], want: list[list[tuple[float, int]] | None],
                  request: Request, what: str, tol: float) -> None:
    """`token_ids_logprob`'s entries agree: at each position the requested ids in their
    order (None where the prompt's first token has no prediction), values within `tol`."""
    assert len(got) == len(want), f"{what}: {len(got)} positions, alone {len(want)}"
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None), what
        if a is not None:
            assert [t for _, t in a] == [t for _, t in b] == list(request.token_ids_logprob), what
            _close([lp for lp, _ in a], [lp for lp, _ in b], what, tol)


def _close_top(got: list[tuple[float, int]], want: list[tuple[float, int]], what: str, tol: float) -> None:
    """Top logprobs agree: the same values within tolerance, the same ids except where a
    value ties with the last one kept (either may be kept)."""
    assert len(got) == len(want), what
    _close([lp for lp, _ in got], [lp for lp, _ in want], what, tol)
    mine, theirs = dict((t, lp) for lp, t in got), dict((t, lp) for lp, t in want)
    floor = min((lp for lp, _ in want), default=0.0)
    for token in set(mine) ^ set(theirs):
        lp = mine.get(token, theirs.get(token))
        if abs(lp - floor) > 2 * tol:
            raise Mismatch(f"{what}: token {token} ({lp}) is in one top list only: {got} vs {want}")


# ---------------------------------------------------------------- the loop


def fuzz(
    models: dict[str, Path],
    *,
    seconds: float,
    seed: int,
    triton_share: float = 0.1,
    int4_share: float = 0.25,
    tp_share: float = 0.0,
    min_workloads: int = 1,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> Stats:
    """Run workloads `seed, seed + 1, ...` on `device` until `seconds` have passed (at least
    `min_workloads`); raises `Mismatch` (naming the workload's seed) at the first
    difference. `MOE_SHARE` of workloads (drawn by a generator of their own) run a
    mixture-of-experts model of `models` where there is one (never with int4 weights,
    which sprig refuses for them), `WINDOW_SHARE` of the others (another generator) a
    sliding-window model. Triton attention is drawn only where it runs: on CUDA, or on the CPU under
    the interpreter (the test session sets it where there is no GPU)."""
    triton_runs = device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    refs = {name: Reference(path, device) for name, path in models.items()}
    stats = Stats()
    start = time.monotonic()
    configs = {name: ModelConfig.from_pretrained(path) for name, path in models.items()}
    sinks = sorted(name for name, c in configs.items() if c.moe is not None and c.moe.clamped_swiglu is not None)
    sparse = sorted(name for name, c in configs.items() if c.moe is not None and name not in sinks)
    vision = sorted(name for name, c in configs.items() if c.image is not None)
    windowed = sorted(name for name, c in configs.items()
                      if c.moe is None and c.sliding_window is not None and c.image is None)
    fused = sorted(name for name, c in configs.items() if c.architecture == "Phi3ForCausalLM")
    names = sorted(set(models) - set(sparse) - set(sinks) - set(windowed) - set(vision) - set(fused))
    i = 0
    while stats.workloads < min_workloads or time.monotonic() - start < seconds:
        workload_seed = seed + i
        rng = random.Random(workload_seed)
        name = names[rng.randrange(len(names))] if names else ""
        moe = random.Random(f"moe {workload_seed}")  # apart from `rng`: older seeds replay unchanged
        window = random.Random(f"window {workload_seed}")
        sight = random.Random(f"vision {workload_seed}")
        sink = random.Random(f"sinks {workload_seed}")
        phi = random.Random(f"fused {workload_seed}")
        if (sparse or sinks) and (not names or moe.random() < MOE_SHARE):
            name = sink.choice(sinks) if sinks and (not sparse or sink.random() < SINK_SHARE) else moe.choice(sparse)
        elif windowed and (not names or window.random() < WINDOW_SHARE):
            name = window.choice(windowed)
        elif vision and (not names or sight.random() < VISION_SHARE):
            name = sight.choice(vision)
        elif fused and (not names or phi.random() < FUSED_SHARE):
            name = phi.choice(fused)
        triton = rng.random() < triton_share and triton_runs
        ref = refs[name]
        workload = make_workload(workload_seed, name, ref.vocab, triton=triton,
                                 int4_share=0.0 if name in sparse + sinks else int4_share, tp_share=tp_share, image=ref.image)
        run_one(workload, models[name], ref, stats)
        i += 1
        if progress is not None and (stats.workloads % 10 == 0):
            progress(f"[{time.monotonic() - start:.0f} s] {stats.line()}")
    return stats


def fuzz_adapters(path: Path) -> dict[str, Path]:
    """Two PEFT LoRA adapters of the model at `path` (`LORA_NAMES`), written beside it once:
    one on attention (q, v, o; rank 8), one on k and the dense MLP (rank 4; on Phi-3, its
    fused qkv_proj and gate_up_proj whole; on a
    mixture-of-experts model, k alone: PEFT adapts the experts, which sprig refuses; on a
    vision-language model, the language model's layers alone). B is
    scaled so that each `scale * B @ A` is about half the size of the tiny models' weights
    (std 0.02): large enough to move their tokens, not so large that it dwarfs the model
    (PEFT's random init alone gives deltas 4x the weights) and blows float32 rounding up past
    the logprob tolerance (seed 95642 at 20x: 1.0e-5)."""
    config = ModelConfig.from_pretrained(path)
    mlp = [] if config.moe else ["gate_proj", "up_proj", "down_proj"]
    targets = [["q_proj", "v_proj", "o_proj"], ["k_proj", *mlp]]
    if config.architecture == "Phi3ForCausalLM":  # its fused modules, as PEFT names them
        targets = [fused_targets(t) for t in targets]
    if config.image is not None:  # the language model's layers only (sprig refuses a vision tower's)
        targets = [rf".*language_model.*\.({'|'.join(t)})" for t in targets]
    a = peft_adapter(path, path.parent / f"{path.name}-lora-a", seed=1, targets=targets[0], scale=0.1)
    b = peft_adapter(path, path.parent / f"{path.name}-lora-b", seed=2, targets=targets[1], r=4, scale=0.1)
    return dict(zip(LORA_NAMES, (a, b), strict=True))


def lora_options(path: Path, options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Engine keywords from `options`, with the adapters' paths where it serves LoRA
    (`max_loras_per_batch` set)."""
    out = dict(options)
    if "max_loras_per_batch" in out:
        out["lora_paths"] = {name: str(p) for name, p in fuzz_adapters(path).items()}
    return out


def stale_copy(path: Path) -> Path:
    """The model at `path` after a 'training step' (other weights), saved beside it once."""
    out = path.parent / f"{path.name}-stale"
    if not (out / "config.json").exists():
        perturbed_copy(path, out, seed=1)
    return out


def run_one(workload: Workload, path: Path, ref: Reference, stats: Stats) -> None:
    """One workload: batched on its engine, then each request against its alone run."""
    options = lora_options(path, tuple(workload.options.items()))
    if options.get("speculative_algorithm") == "draft":
        options = {**options, "speculative_draft_model_path": str(truncated_draft(path))}
    key = reference_key(workload.options)
    alone = {r.rid: ref.alone(r, key) for r in workload.requests if r.checked} if workload.perturbed_trees else {}
    start = stale_copy(path) if workload.stale_start else path
    with Engine(str(start), dtype="float32", device=ref.device, shadow_attention=True, check_integrity=True,
                **options) as engine:
        if workload.stale_start:
            try:
                drive(engine, workload.requests)
            except Exception as e:
                raise Mismatch(f"{workload.describe()}\nthe run on other weights failed: {e!r}") from e
            ok, message, _ = engine.update_weights_from_disk(str(path))
            assert ok, f"{workload.describe()}\nthe weight update failed: {message}"
            stats.weight_updates += 1
        if workload.perturbed_trees:
            runs = [[*r.prompt, *o.ids] for r in workload.requests if r.checked for o in alone[r.rid].values()]
            engine.scheduler.speculative.drafter = ContextDrafts(PerturbedTrees(runs, workload.seed))
        try:
            got = drive(engine, workload.requests, workload.pauses)
        except Exception as e:
            raise Mismatch(f"{workload.describe()}\nthe batched run failed: {e!r}") from e
        stats.pauses += len(workload.pauses)
        stats.retractions += engine.scheduler.stats.retractions
        stats.preemptions += engine.scheduler.stats.preemptions
        if engine.scheduler.speculative is not None:
            stats.alternatives += engine.scheduler.speculative.stats.alternatives
            stats.alternatives_kept += engine.scheduler.speculative.stats.alternatives_kept
    check_workload(workload, got, ref, stats, alone)
    stats.workloads += 1
    backend = options["attention_backend"]
    stats.by_backend[backend] = stats.by_backend.get(backend, 0) + 1
    kv = "kv " + options.get("kv_cache_dtype", "auto")
    stats.by_kv_cache[kv] = stats.by_kv_cache.get(kv, 0) + 1
    weights = "weights " + options.get("quantization", "float")
    stats.by_weights[weights] = stats.by_weights.get(weights, 0) + 1
    spec = "spec " + (options.get("speculative_algorithm") or "off") + (" (runner rounds)" if options.get("disable_draft_decoder") else "")
    spec += " (perturbed trees)" if workload.perturbed_trees else ""
    stats.by_spec[spec] = stats.by_spec.get(spec, 0) + 1
    tp = f"tp {options.get('tp_size', 1)}"
    stats.by_tp[tp] = stats.by_tp.get(tp, 0) + 1
    stats.by_model[workload.model] = stats.by_model.get(workload.model, 0) + 1
