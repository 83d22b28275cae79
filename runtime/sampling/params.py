"""Per-request sampling parameters: SGLang's names and defaults, validated once at the edge.

A `SamplingParams` that exists is valid: `__post_init__` normalizes every field to its
canonical type (tuples, ints, floats, str keys turned into int keys) and rejects bad
values with a `ValueError` that names the parameter and its allowed range. The only
check left for later is `validate_for_model`, which needs the vocabulary size. A
`SamplingParams` crosses between processes as itself (`wire.register`), its checks not
run again on arrival.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sprig.runtime import json_limits, stop_regex, wire

GREEDY_TEMPERATURE = 1e-6  # temperatures below this decode greedily (as SGLang)
MAX_N = 128
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 16
MAX_EBNF_CHARS = 64 * 1024  # grammars seen in practice (JSON, SQL, C subsets) are a few KB
MAX_MARKER_CHARS = 64
MAX_REASONING_EXITS = 8
_ALIASES = {"sampling_seed": "seed"}
_BOOL_FIELDS = (
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
)
_SEED_RULE = "an integer in [-2**63, 2**64)"


def _fail(name: str, rule: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {rule}; got {value!r}")


def _int(name: str, value: object, rule: str, ok: Callable[[int], bool]) -> int:
    """An int (an integral float is accepted; a bool is not) for which `ok` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, rule, value)
    integral = isinstance(value, numbers.Integral) or (
        math.isfinite(value) and float(value).is_integer()
    )
    if not (integral and ok(int(value))):
        raise _fail(name, rule, value)
    return int(value)


def _float(name: str, value: object, rule: str, ok: Callable[[float], bool]) -> float:
    """A finite float (an int is accepted; a bool is not) for which `ok` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, rule, value)
    if not (math.isfinite(value) and ok(float(value))):
        raise _fail(name, rule, value)
    return float(value)


def _clip(value: object) -> object:
    """`value` as an error message may quote it: long text cut short."""
    return value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "true or false", value)
    return value


def _seed_ok(seed: int) -> bool:
    return -(2**63) <= seed < 2**64


def _token_id(name: str, value: object) -> int:
    """A token id; JSON object keys arrive as strings of ints, so those are accepted."""
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise _fail(name, "keyed by integer token ids", value) from None
    return _int(name, value, "an integer token id >= 0", lambda t: t >= 0)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Invariants after construction: ints are ints, floats are finite floats, `stop`,
    `stop_regex` (compiling patterns, see `sprig.runtime.stop_regex`), `stop_token_ids`
    and `reasoning_exits` are de-duplicated tuples, `top_k` is -1 (off) or >= 1 (0 is accepted
    as off and stored as -1, as vLLM and OpenAI-style clients send it), `logit_bias` has
    int keys, `json_schema` is a JSON string. Greedy decoding is `temperature` below
    `GREEDY_TEMPERATURE` or `top_k == 1`. `logit_bias` must be treated as read-only.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    reasoning_start: str | None = None
    reasoning_end: str | None = None
    reasoning_exits: tuple[str, ...] = ()
    thinking_budget: int | None = None
    constraint_trigger: str | None = None

    def __post_init__(self) -> None:
        for name, (kind, rule, ok) in _NUMBER_RULES.items():
            self._put(name, kind(name, getattr(self, name), rule, ok))
        if self.min_new_tokens > self.max_new_tokens:
            raise _fail(
                "min_new_tokens",
                f"in [0, max_new_tokens={self.max_new_tokens}]",
                self.min_new_tokens,
            )
        if self.top_k == 0:
            self._put("top_k", -1)
        for name in _BOOL_FIELDS:
            self._put(name, _bool(name, getattr(self, name)))
        self._put("stop", self._stop_strings(self.stop))
        self._put("stop_regex", stop_regex.check_patterns(self.stop_regex))
        self._put("stop_token_ids", self._stop_token_ids(self.stop_token_ids))
        if self.seed is not None:
            self._put("seed", _int("seed", self.seed, _SEED_RULE, _seed_ok))
        if self.logit_bias is not None:
            self._put("logit_bias", self._logit_bias(self.logit_bias))
        if self.regex is not None and not isinstance(self.regex, str):
            raise _fail("regex", "a string", self.regex)
        if self.json_schema is not None:
            self._put("json_schema", self._json_schema(self.json_schema))
        if self.ebnf is not None and not (isinstance(self.ebnf, str) and 0 < len(self.ebnf) <= MAX_EBNF_CHARS):
            raise _fail("ebnf", f"a grammar of 1 to {MAX_EBNF_CHARS} characters", _clip(self.ebnf))
        given = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are mutually exclusive; give at most one")
        self._check_markers(given)

    def _check_markers(self, constraints: list[str]) -> None:
        """`reasoning_end`: a constraint (regex, json_schema, ...) applies only to the text
        after this marker; the output opens inside the reasoning, or, with
        `reasoning_start`, may open it with that marker or answer at once.
        `reasoning_exits`: the texts of stop tokens that may end the output before
        `reasoning_end` (harmony's `<|call|>`: a tool call in place of the answer); every
        other stop token stays forbidden there.
        `thinking_budget`: the most tokens the reasoning (before `reasoning_end`) may take;
        then the output writes `reasoning_end` and goes on with the answer. Needs
        `reasoning_end`; with no constraint it is the only thing gated.
        `constraint_trigger`: the constraint applies only to the text after the first time
        the output (the answer, after any reasoning) writes this text; before it the
        output is free and may end."""
        for name in ("reasoning_start", "reasoning_end", "constraint_trigger"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_MARKER_CHARS):
                raise _fail(name, f"a non-empty string of at most {MAX_MARKER_CHARS} characters", value)
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("reasoning_start needs reasoning_end")
        self._put("reasoning_exits", self._reasoning_exits(self.reasoning_exits))
        if self.reasoning_exits and self.reasoning_end is None:
            raise ValueError("reasoning_exits needs reasoning_end")
        if self.thinking_budget is not None:
            self._put("thinking_budget", _int("thinking_budget", self.thinking_budget, ">= 0", lambda v: v >= 0))
            if self.reasoning_end is None:
                raise ValueError("thinking_budget needs reasoning_end, the marker that ends the reasoning "
                                 "(a server started with --reasoning-parser sets it)")
        if self.constraint_trigger is not None and not constraints:
            raise ValueError("constraint_trigger needs a constraint: regex, json_schema or ebnf")

    def _put(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    @staticmethod
    def _stop_strings(stop: object) -> tuple[str, ...]:
        rule = f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings"
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or len(items) > MAX_STOP_STRINGS:
            raise _fail("stop", rule, stop)
        if not all(isinstance(s, str) and s for s in items):
            raise _fail("stop", rule, stop)
        return tuple(dict.fromkeys(items))

    @staticmethod
    def _reasoning_exits(exits: object) -> tuple[str, ...]:
        rule = f"a list of at most {MAX_REASONING_EXITS} non-empty strings of at most {MAX_MARKER_CHARS} characters"
        if not isinstance(exits, (list, tuple)) or len(exits) > MAX_REASONING_EXITS:
            raise _fail("reasoning_exits", rule, exits)
        if not all(isinstance(e, str) and 0 < len(e) <= MAX_MARKER_CHARS for e in exits):
            raise _fail("reasoning_exits", rule, exits)
        return tuple(dict.fromkeys(exits))

    @staticmethod
    def _stop_token_ids(ids: object) -> tuple[int, ...]:
        rule = f"a list of at most {MAX_STOP_TOKEN_IDS} integer token ids >= 0"
        if not isinstance(ids, (list, tuple, set, frozenset)) or len(ids) > MAX_STOP_TOKEN_IDS:
            raise _fail("stop_token_ids", rule, ids)
        return tuple(dict.fromkeys(_int("stop_token_ids", t, rule, lambda v: v >= 0) for t in ids))

    @staticmethod
    def _logit_bias(bias: object) -> dict[int, float]:
        rule = f"a mapping of at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases in [-100, 100]"
        if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise _fail("logit_bias", rule, bias)
        out = {
            _token_id("logit_bias", k): _float("logit_bias", v, rule, lambda b: -100 <= b <= 100)
            for k, v in bias.items()
        }
        if len(out) != len(bias):
            raise ValueError(f"logit_bias has duplicate token ids: {bias!r}")
        return out

    @staticmethod
    def _json_schema(schema: object) -> str:
        if isinstance(schema, str):
            json_limits.loads(schema, "json_schema")
            return schema
        if isinstance(schema, Mapping):
            try:
                return json.dumps(json_limits.check_depth(schema, "json_schema"))
            except TypeError as e:
                raise ValueError(f"json_schema must be valid JSON: {e}") from None
        raise _fail("json_schema", "a JSON schema (object or string)", schema)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def stop_token_set(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """Token ids that end this request: `stop_token_ids`, plus the model's EOS ids
        unless `ignore_eos` (then EOS is an ordinary token). The stop checker and the
        min-new-tokens mask both use this set, so they agree."""
        eos = () if self.ignore_eos else tuple(eos_ids)
        return frozenset(self.stop_token_ids).union(eos)

    def validate_for_model(self, vocab_size: int) -> None:
        """Raise `ValueError` if a token id given in `stop_token_ids` or `logit_bias`
        is outside the model's vocabulary `[0, vocab_size)`."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or {}),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise _fail(name, f"token ids in [0, {vocab_size})", bad)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a request's `sampling_params` JSON object.

        Unknown keys raise `ValueError` naming the key; `sampling_seed` is an alias of
        `seed`; a null value means the default (as SGLang does).
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise _fail("sampling_params", "an object", d)
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _ALIASES.get(key, key)
            if name not in _FIELDS:
                raise ValueError(f"unknown sampling parameter {key!r}")
            if name in kwargs:
                raise ValueError(f"sampling parameter {name!r} given twice (via an alias)")
            if value is not None:
                kwargs[name] = value
        return cls(**kwargs)

_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_NUMBER_RULES: dict[str, tuple[Callable[..., Any], str, Callable[[Any], bool]]] = {
    "max_new_tokens": (_int, ">= 0", lambda v: v >= 0),
    "min_new_tokens": (_int, "in [0, max_new_tokens]", lambda v: v >= 0),
    "temperature": (_float, ">= 0", lambda v: v >= 0),
    "top_p": (_float, "in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": (_int, "-1 or 0 (off) or >= 1", lambda v: v >= -1),
    "min_p": (_float, "in [0, 1]", lambda v: 0 <= v <= 1),
    "frequency_penalty": (_float, "in [-2, 2]", lambda v: -2 <= v <= 2),
    "presence_penalty": (_float, "in [-2, 2]", lambda v: -2 <= v <= 2),
    "repetition_penalty": (_float, "> 0 (1 = off)", lambda v: v > 0),
    "n": (_int, f"in [1, {MAX_N}]", lambda v: 1 <= v <= MAX_N),
}

wire.register(SamplingParams, tuples=frozenset({"stop", "stop_regex", "stop_token_ids", "reasoning_exits"}))
