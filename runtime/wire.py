"""Every message that crosses a process boundary, and their msgpack codec (no pickle).

Flow: HTTP --TokenizedRequest/AbortReq/ControlReq--> scheduler --DetokRegister/TokenBatch/
Forget--> detokenizer --DetokenizedBatch--> HTTP; the scheduler also sends RequestError,
StatsReport and ControlReply straight to HTTP, both children send HTTP a Heartbeat about
once a second, and each child reports a StartupReport to the launcher once.

Fields are plain (str, int, float, bool, None, lists, dicts) or registered messages, so
msgpack carries them as they are. `decode` builds only registered classes: a peer can
name no other type. This module imports nothing of sprig: every process, and the offline
engine, builds these records from its own state. The request a client sends,
`TokenizedRequest` (with its `LogprobOptions`, `runtime/request_contract.py`, and its
`SamplingParams`, `runtime/sampling/params.py`), is defined and registered where it is
validated (`register`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack


@dataclass
class TokenOutput:
    """What one scheduler step added to one request (the scheduler's `collect_output`).
    Logprob entries are `[logprob, token_id]` pairs; `input_*` are sent once, in the step
    where the prompt finished prefilling. `text_delta` is the text the step added when the
    scheduler decoded it (a request with stop strings or `stop_regex`, whose stops it
    checks on its text), else None: the detokenizer decodes it. Either way a request's
    text is decoded once."""

    rid: str
    new_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    jump_forward_tokens: int = 0
    spec_accept_histogram: list[int] = field(default_factory=list)  # speculative passes by drafts kept
    spec_drafted: int = 0  # drafts verified for it so far
    retractions: int = 0  # times it was retracted to free KV slots, so far
    finish_reason: dict[str, Any] | None = None
    output_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None
    output_token_ids_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[Any]] | None] | None = None
    text_delta: str | None = None
    embedding: list[float] | None = None  # an embedding request's, in its last output
    weight_version: str = ""  # the label of the weights it ran on


@dataclass
class DetokenizedOutput(TokenOutput):
    """A `TokenOutput` with its text: `text_delta` is what the step added to the request's
    text, and logprob entries are `[logprob, token_id, text | None]`."""

    text_delta: str = ""


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request answered by one `ControlReply` with the same token: `kind` is
    "flush_cache", "check_integrity", "update_weights" (`args`: `model_path`,
    `weight_version`, `abort_all_requests`), "update_weight_version" (`args`:
    `weight_version`, `abort_all_requests`), "get_weights_by_name" (`args`: `name`,
    `truncate_size`), "load_lora_adapter" (`args`: `lora_name`, `lora_path`) or
    "unload_lora_adapter" (`args`: `lora_name`); anything else gets `ok=False`."""

    token: int
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ControlReply:
    token: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class DetokRegister:
    """How to detokenize `rid`; sent on the same socket before its first `TokenBatch`.
    Text is decoded at each step only if `incremental` (a streamed request); a request
    whose outputs carry their `text_delta` (the scheduler decoded it) is not decoded here."""

    rid: str
    prompt_tail: list[int]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprob_text: bool = False
    incremental: bool = True


@dataclass
class TokenBatch:
    outputs: list[TokenOutput]


@dataclass
class Forget:
    """Drop the detokenizer state of these rids (their clients got an error instead)."""

    rids: list[str]


@dataclass
class DetokenizedBatch:
    outputs: list[DetokenizedOutput]


@dataclass
class RequestError:
    """`rid` failed and will get no further output. `status` is the HTTP status to answer
    with: 400 (rejected as given), 503 (queue full), 500 (internal error)."""

    rid: str
    message: str
    status: int = 400


@dataclass
class StatsReport:
    """The scheduler's state, sent periodically while busy and once on becoming idle.
    Token counters are totals since start; `integrity` is "ok", "unchecked" or the error
    of the KV check at the last idle moment."""

    running: int
    queued: int
    kv_used: int
    kv_size: int
    cache_hit_rate: float
    prefill_tokens: int
    cached_tokens: int
    decode_tokens: int
    retractions: int
    extend_steps: int
    decode_steps: int
    gen_throughput: float
    prefill_throughput: float
    integrity: str = "unchecked"
    spec_accept_rate: float = 0.0  # speculative decoding: drafts accepted / drafted since start
    spec_accept_length: float = 0.0  # tokens per request per verification pass since start
    preemptions: int = 0  # retractions for a waiting request of higher priority, since start


@dataclass
class Heartbeat:
    """A child's sign of life, sent from its main loop about once a second (a loop stuck
    in one step sends none): the HTTP process's watchdog reads them."""

    name: str  # "scheduler" or "detokenizer"


@dataclass
class StartupReport:
    """A child's first message to the launcher: ready (with `info`) or failed (`error`)."""

    ok: bool
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)


_TAG = "__msg__"
Build = Callable[[dict[str, Any]], Any]
_TYPES: dict[str, tuple[type, Build]] = {
    cls.__name__: (cls, lambda fields, cls=cls: cls(**fields))
    for cls in (
        AbortReq, ControlReq, ControlReply, DetokRegister, TokenBatch, Forget,
        DetokenizedBatch, RequestError, StatsReport, StartupReport, TokenOutput, DetokenizedOutput, Heartbeat,
    )
}


def register(cls: type, tuples: frozenset[str] = frozenset()) -> None:
    """Let dataclass `cls`, defined elsewhere, cross as a message. A peer's `cls` is
    rebuilt field by field as the fields arrive (lists back to tuples for the fields named
    in `tuples`), without `__post_init__`: its checks ran where the sender built it. A
    missing or unknown field is a `ValueError`. The module defining `cls` registers it,
    so a process that sends or receives one has it registered."""
    if _TYPES.get(cls.__name__, (cls,))[0] is not cls:
        raise ValueError(f"another message is already registered as {cls.__name__}")
    names = frozenset(f.name for f in dataclasses.fields(cls))

    def build(fields: dict[str, Any]) -> Any:
        if fields.keys() != names:
            raise ValueError(f"malformed {cls.__name__}: fields {sorted(fields.keys() ^ names)}")
        obj = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(obj, name, tuple(value) if name in tuples else value)
        return obj

    _TYPES[cls.__name__] = (cls, build)


def _default(obj: object) -> dict[str, Any]:
    name = type(obj).__name__
    if _TYPES.get(name, (None,))[0] is not type(obj):
        raise TypeError(f"cannot encode {type(obj).__qualname__}: not a registered message")
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    out[_TAG] = name
    return out


def _object_hook(d: dict[Any, Any]) -> Any:
    name = d.pop(_TAG, None)
    if name is None:
        return d
    entry = _TYPES.get(name)
    if entry is None:
        raise ValueError(f"unknown message type {name!r}")
    return entry[1](d)


def encode(msg: object) -> bytes:
    """msgpack bytes of a registered message (messages may nest)."""
    return msgpack.packb(msg, default=_default)


def decode(data: bytes) -> Any:
    """The message `encode` produced; `ValueError`/`TypeError` on anything else."""
    return msgpack.unpackb(data, object_hook=_object_hook, strict_map_key=False)
