"""The request contract: every check a generation request must pass, in one place.

`build_requests` turns one call (prompts, sampling parameters, logprob options, ids) into
`TokenizedRequest`s, one per sequence to generate, or raises `InvalidRequest` naming the
offending field. The HTTP routes (`runtime/server/request_builder.py`) and the offline
`Engine` both call it; nothing downstream validates a request again (the scheduler
checks only what it alone knows: a rid in use, the KV pool's size, its queue bound).

A `TokenizedRequest` crosses to the scheduler process as a typed msgpack message
(`runtime/wire.py` codec, registered here; its `SamplingParams` likewise): it is
rebuilt there field by field, without running the checks again, since only a request
built here is ever sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sprig.runtime import wire
from sprig.runtime.multimodal.inputs import TEXT_ONLY, ImageInput
from sprig.runtime.sampling import SamplingParams

SamplingArg = dict[str, Any] | SamplingParams | Sequence[dict[str, Any] | SamplingParams] | None


class InvalidRequest(ValueError):
    """A request that cannot be served as given; `field` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelLimits:
    """What the model allows: ids in `[0, vocab_size)`, prompt + output <= `context_len`;
    for a model that takes images, `image_token_id` appears in a prompt only in the runs
    its images fill (None: a text-only model, whose prompts may hold any id)."""

    context_len: int
    vocab_size: int
    image_token_id: int | None = None


MAX_TOKEN_IDS_LOGPROB = 256
EMBED_PARAMS = SamplingParams(max_new_tokens=0)  # an embedding request's: it ends after its prefill


@dataclass(frozen=True)
class LogprobOptions:
    """Which logprobs a request reports: output tokens' with `return_logprob`, prompt
    tokens' from `logprob_start_len` on (-1: none), the `top_logprobs_num` most likely
    tokens at each position and the logprobs of the `token_ids_logprob` tokens there (in
    the order given, at most `MAX_TOKEN_IDS_LOGPROB`), and the tokens' texts with
    `return_text_in_logprobs`."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    token_ids_logprob: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("return_logprob", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be true or false", name)
        for name, low in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequest(f"{name} must be an integer >= {low}; got {value!r}", name)
        ids = self.token_ids_logprob
        if not isinstance(ids, tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest("token_ids_logprob must be a list of token ids", "token_ids_logprob")
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise InvalidRequest(f"token_ids_logprob has {len(ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB}",
                                 "token_ids_logprob")

    @classmethod
    def per_prompt(cls, prompts: int, return_logprob: Any = False, logprob_start_len: Any = -1,
                   top_logprobs_num: Any = 0, return_text_in_logprobs: bool = False,
                   token_ids_logprob: Any = None) -> list[LogprobOptions]:
        """One `LogprobOptions` for each of a call's `prompts`, as SGLang's `/generate` takes
        them: each of `return_logprob`, `logprob_start_len` and `top_logprobs_num` is one
        value for every prompt or a list with one per prompt; `token_ids_logprob` is None,
        one id, one list of ids for every prompt or a list of such lists, one per prompt (a
        prompt's `n` samples share its entry). Raises `InvalidRequest` naming a list of the
        wrong length or a bad value."""
        columns = []
        for name, value in (("return_logprob", return_logprob), ("logprob_start_len", logprob_start_len),
                            ("top_logprobs_num", top_logprobs_num),
                            ("token_ids_logprob", _token_ids_per_prompt(token_ids_logprob))):
            if not isinstance(value, list):  # one value (for token_ids_logprob, one tuple) for all
                columns.append([value] * prompts)
            elif len(value) != prompts:
                raise InvalidRequest(f"{name} has {len(value)} entries for {prompts} prompts", name)
            else:
                columns.append(list(value))
        return [cls(lp, start, top, return_text_in_logprobs, ids) for lp, start, top, ids in zip(*columns, strict=True)]


def _token_ids_per_prompt(value: Any) -> tuple[int, ...] | list[Any]:
    """SGLang's shapes of `token_ids_logprob`: the ids for every prompt as a tuple, or the
    list with one entry per prompt (each a tuple when it is a list)."""
    if value is None or (isinstance(value, list | tuple) and not value):
        return ()
    if not isinstance(value, list | tuple):
        return (value,)
    if not any(isinstance(v, list | tuple) for v in value):
        return tuple(value)
    return [tuple(v) if isinstance(v, list | tuple) else v for v in value]


PRIORITY_OFF = ("priority is taken only where requests are scheduled by it: start the server with "
                "--enable-priority-scheduling (Engine: enable_priority_scheduling=True)")


@dataclass(frozen=True)
class TokenizedRequest:
    """One sequence to generate, valid for the model it was built for: a non-empty prompt
    of ids in the vocabulary, prompt + `params.max_new_tokens` within the context, sampling
    parameters (constraints included) checked against the vocabulary. Only a `stream`ed
    request's text is decoded step by step. An `embed` request generates nothing
    (`max_new_tokens` 0, no logprobs, not streamed): it reports its prompt's embedding.
    `images` (a model that takes images) are in prompt order, each over its own run of
    the model's image tokens, and those runs are the only image tokens of the prompt."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    logprobs: LogprobOptions = LogprobOptions()
    stream: bool = False
    embed: bool = False
    priority: int | None = None  # under priority scheduling (`SchedulerConfig`); None: the default, 0
    lora_path: str | None = None  # the name of the LoRA adapter it runs with (SGLang's field); None: the base model
    images: tuple[ImageInput, ...] = ()


def prompt_rows(text: Any, input_ids: Any, encode: Callable[[str], list[int]], *,
                text_field: str = "text") -> tuple[bool, list[list[int]]]:
    """(is_batch, token ids per prompt) from exactly one of `text` (a string or a list of
    strings, tokenized by `encode`) and `input_ids` (a list of ints or of lists of ints)."""
    if (text is None) == (input_ids is None):
        raise InvalidRequest(f"give exactly one of {text_field} and input_ids", text_field)
    if text is not None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest(f"{text_field} must be a string or a list of strings", text_field)
        if not texts:
            raise InvalidRequest(f"{text_field} must not be an empty list", text_field)
        return not isinstance(text, str), [encode(t) for t in texts]
    if not isinstance(input_ids, list) or not input_ids:
        raise InvalidRequest("input_ids must be a non-empty list of ints or of lists of ints", "input_ids")
    batch = isinstance(input_ids[0], list)
    rows = input_ids if batch else [input_ids]
    for row in rows:
        if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise InvalidRequest("input_ids must be a list of ints or a list of lists of ints", "input_ids")
    return batch, [list(r) for r in rows]


def build_requests(prompts: list[list[int]], sampling: SamplingArg, limits: ModelLimits, *,
                   rid: Any = None, new_rid: Callable[[], str],
                   logprobs: LogprobOptions | Sequence[LogprobOptions] = LogprobOptions(),
                   stream: bool = False, prompt_field: str = "input_ids",
                   priority: int | None = None, lora_path: Any = None,
                   images: Sequence[tuple[ImageInput, ...]] | None = None) -> list[TokenizedRequest]:
    """Every sequence of one call in output order: prompt by prompt, `n` samples each
    (sample j of n > 1 has rid `f"{rid}-{j}"` and seed `seed + j`). `sampling`: one
    `SamplingParams` or dict for all prompts, or a list with one per prompt; `logprobs`
    likewise (`LogprobOptions.per_prompt`); `rid`: one string per prompt (or None:
    `new_rid()` each). `prompt_field` names the prompts in errors. `priority` (every
    sequence's; a 32-bit int) is for a scheduler that schedules by it. `lora_path`: the
    LoRA adapter's name for all prompts, or a list with one (or None) per prompt; the
    scheduler checks it is loaded. `images`: each prompt's (`ImagePrompter`), or None for
    none. Raises `InvalidRequest` naming the field at fault."""
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)
                                 or not -(2**31) <= priority < 2**31):
        raise InvalidRequest(f"priority must be a 32-bit integer, got {priority!r}", "priority")
    per_prompt = [()] * len(prompts) if images is None else list(images)
    if len(per_prompt) != len(prompts):
        raise InvalidRequest(f"images for {len(per_prompt)} prompts, not {len(prompts)}", "image_data")
    for row, imgs in zip(prompts, per_prompt, strict=True):
        check_prompt(row, limits, prompt_field)
        _check_images(row, imgs, limits, prompt_field)
    params = _params_per_prompt(sampling, len(prompts), limits)
    for row, p in zip(prompts, params, strict=True):
        if len(row) + p.max_new_tokens > limits.context_len:
            raise InvalidRequest(
                f"prompt ({len(row)} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the model's "
                f"context length {limits.context_len}",
                "max_new_tokens",
            )
    options = [logprobs] * len(prompts) if isinstance(logprobs, LogprobOptions) else list(logprobs)
    if len(options) != len(prompts):
        raise InvalidRequest(f"logprob options for {len(options)} prompts, not {len(prompts)}", "return_logprob")
    if any(o.top_logprobs_num > limits.vocab_size for o in options):
        raise InvalidRequest(f"top_logprobs_num must be <= {limits.vocab_size}", "top_logprobs_num")
    if bad := [t for o in options for t in o.token_ids_logprob if not 0 <= t < limits.vocab_size]:
        raise InvalidRequest(f"token_ids_logprob has token ids outside [0, {limits.vocab_size}): {bad[:5]}",
                             "token_ids_logprob")
    rids = _rids_per_prompt(rid, len(prompts), new_rid)
    adapters = _adapters_per_prompt(lora_path, len(prompts))
    out = []
    for r, ids, p, lp, adapter, imgs in zip(rids, prompts, params, options, adapters, per_prompt, strict=True):
        for j in range(p.n):
            try:
                seq_params = p if p.n == 1 or p.seed is None else replace(p, seed=p.seed + j)
            except ValueError as e:  # a seed + sample index out of range
                raise InvalidRequest(str(e), "sampling_params") from None
            out.append(TokenizedRequest(f"{r}-{j}" if p.n > 1 else r, tuple(ids), seq_params, lp, stream,
                                        priority=priority, lora_path=adapter, images=imgs))
    if len({s.rid for s in out}) < len(out):
        raise InvalidRequest("the request ids of one call must be distinct", "rid")
    return out


def _adapters_per_prompt(lora_path: Any, n: int) -> list[str | None]:
    """One adapter name (or None) per prompt from `lora_path`: None, a name, or a list of n."""
    if lora_path is None or isinstance(lora_path, str):
        values = [lora_path] * n
    elif isinstance(lora_path, list) and len(lora_path) == n:
        values = lora_path
    else:
        raise InvalidRequest(f"lora_path must be an adapter name or a list of {n} (one per prompt)", "lora_path")
    if not all(v is None or (isinstance(v, str) and v) for v in values):
        raise InvalidRequest("lora_path must hold adapter names (non-empty strings) or null", "lora_path")
    return values


def build_embedding_requests(prompts: list[list[int]], limits: ModelLimits, *, rid: Any = None,
                             new_rid: Callable[[], str], prompt_field: str = "input_ids",
                             lora_path: Any = None) -> list[TokenizedRequest]:
    """One `embed` request per prompt, in order (`rid` and `lora_path` as in
    `build_requests`). Raises `InvalidRequest` naming the field at fault."""
    for row in prompts:
        check_prompt(row, limits, prompt_field)
        _check_images(row, (), limits, prompt_field)
    rids = _rids_per_prompt(rid, len(prompts), new_rid)
    if len(set(rids)) < len(rids):
        raise InvalidRequest("the request ids of one call must be distinct", "rid")
    adapters = _adapters_per_prompt(lora_path, len(prompts))
    return [TokenizedRequest(r, tuple(ids), EMBED_PARAMS, embed=True, lora_path=adapter)
            for r, ids, adapter in zip(rids, prompts, adapters, strict=True)]


def check_prompt(row: list[int], limits: ModelLimits, field: str) -> None:
    """A prompt's ids: not empty, shorter than the context, each in the vocabulary;
    `InvalidRequest` naming `field` otherwise."""
    if not row:
        raise InvalidRequest(f"{field} must not contain an empty prompt", field)
    if len(row) >= limits.context_len:
        raise InvalidRequest(
            f"a prompt of {field} has {len(row)} tokens, which exceeds what the model's context length "
            f"({limits.context_len} tokens, output included) leaves for a prompt", field,
        )
    if bad := [t for t in row if not 0 <= t < limits.vocab_size]:
        raise InvalidRequest(f"{field} has token ids outside [0, {limits.vocab_size}): {bad[:5]}", field)


def _check_images(row: list[int], images: tuple[ImageInput, ...], limits: ModelLimits, field: str) -> None:
    """The prompt's image tokens are exactly its images' runs (`ModelLimits.image_token_id`)."""
    token = limits.image_token_id
    if token is None:
        if images:
            raise InvalidRequest(TEXT_ONLY, "image_data")
        return
    covered = 0
    for image in images:
        if image.end > len(row) or any(t != token for t in row[image.offset : image.end]):
            raise InvalidRequest(f"an image's placeholders do not match {field}", "image_data")
        covered += image.length
    if row.count(token) != covered:
        raise InvalidRequest(f"{field} holds image tokens ({token}) that no image in image_data fills", field)


def _params_per_prompt(arg: SamplingArg, n: int, limits: ModelLimits) -> list[SamplingParams]:
    """A list must have one entry per prompt; a single dict applies to all."""

    def one(p: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        params = p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
        params.validate_for_model(limits.vocab_size)
        return params

    try:
        if isinstance(arg, list | tuple):
            if len(arg) != n:
                raise ValueError(f"sampling_params has {len(arg)} entries for {n} prompts")
            return [one(p) for p in arg]
        return [one(arg)] * n
    except ValueError as e:
        raise InvalidRequest(str(e), "sampling_params") from None


def _rids_per_prompt(rid: Any, n: int, new_rid: Callable[[], str]) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(n)]
    rids = [rid] if isinstance(rid, str) else list(rid) if isinstance(rid, list | tuple) else None
    if rids is None or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
        raise InvalidRequest(f"rid must be a non-empty string or a list of {n} non-empty strings", "rid")
    return rids


wire.register(LogprobOptions, tuples=frozenset({"token_ids_logprob"}))
wire.register(TokenizedRequest, tuples=frozenset({"prompt_ids", "images"}))
