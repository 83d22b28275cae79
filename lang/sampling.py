"""Sampling parameters as a program sees them: per-gen overrides over per-run defaults.

Field names are the native `/generate` names (`max_new_tokens`, not `max_tokens`). A field
left at `None` is unset: `merged` takes the override's set fields over the defaults, and
`to_native` sends only set fields, so the server's own defaults apply to the rest.
`dtype` is not a server field: `resolve_dtype` turns it into SGLang's regex (and, for
numbers, the stop strings SGLang adds) before a request is built, and `parse_typed`
turns the generated text of a number or bool back into the Python value.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPES: dict[str, tuple[type, str, tuple[str, ...]]] = {
    "int": (int, REGEX_INT, (" ", "\n")),
    "float": (float, REGEX_FLOAT, (" ", "\n")),
    "str": (str, REGEX_STR, ()),
    "bool": (bool, REGEX_BOOL, ()),
}
_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_LOCAL_FIELDS = ("dtype", *_LOGPROB_FIELDS)
_NATIVE_NAMES = {"seed": "sampling_seed"}  # SGLang's name; a sprig server takes either


def dtype_name(dtype: type | str | None) -> str | None:
    """'int' | 'float' | 'str' | 'bool' for a type or its name; `None` stays `None`."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", "")
    name = {"string": "str"}.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of int, float, str, bool; got {dtype!r}")
    return name


def _stop_tuple(stop: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    if stop is None:
        return None
    return (stop,) if isinstance(stop, str) else tuple(stop)


@dataclass(frozen=True)
class GenParams:
    """One gen's sampling parameters; every field `None` means "not set".

    Invariants: `stop` and `stop_regex` are tuples; `dtype` is a canonical name or None; `json_schema` is a
    JSON string; `regex` and `dtype` are not both set (dtype *is* a regex).
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: tuple[str, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    dtype: str | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _stop_tuple(self.stop))
        object.__setattr__(self, "stop_regex", _stop_tuple(self.stop_regex))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if isinstance(self.json_schema, Mapping):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        if self.dtype is not None and self.regex is not None:
            raise ValueError("give dtype or regex, not both: a dtype is a regex")
        if self.n is not None and self.n < 1:
            raise ValueError(f"n must be >= 1; got {self.n}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int; got {self.seed!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0; got {self.max_new_tokens}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def merged(self, overrides: GenParams) -> GenParams:
        """These parameters with every set field of `overrides` taking precedence."""
        changes = {k: v for k, v in dataclasses.asdict(overrides).items() if v is not None}
        if changes.get("dtype") is not None or changes.get("regex") is not None:
            changes.setdefault("dtype", None)
            changes.setdefault("regex", None)
        return dataclasses.replace(self, **changes)

    def with_stop(self, extra: tuple[str, ...]) -> GenParams:
        """`stop` extended by `extra` (order kept, duplicates dropped)."""
        if not extra:
            return self
        return dataclasses.replace(self, stop=tuple(dict.fromkeys((*(self.stop or ()), *extra))))

    def resolve_dtype(self) -> GenParams:
        """`dtype` replaced by its regex (and stop strings), as SGLang's backend does."""
        if self.dtype is None:
            return self
        _, regex, stops = _DTYPES[self.dtype]
        return dataclasses.replace(self, regex=regex, dtype=None).with_stop(stops)

    def to_native(self) -> dict[str, Any]:
        """The `sampling_params` object of a `/generate` request (set fields only)."""
        if self.dtype is not None:
            return self.resolve_dtype().to_native()
        out = {}
        for name in self.field_names():
            value = getattr(self, name)
            if value is not None and name not in _LOCAL_FIELDS:
                out[_NATIVE_NAMES.get(name, name)] = list(value) if isinstance(value, tuple) else value
        return out

    def logprob_fields(self) -> dict[str, Any]:
        """The top-level logprob fields of a `/generate` request (set fields only)."""
        return {k: getattr(self, k) for k in _LOGPROB_FIELDS if getattr(self, k) is not None}


def parse_typed(text: str, dtype: str | None) -> Any:
    """The Python value of a gen constrained by `dtype`: an int, float or bool parsed
    from the text; for `str` (as for None) the text as generated, quotes included, as
    SGLang binds it (a `stop` may have cut it before its closing quote).

    Raises ValueError when the text of an int, float or bool gen does not parse, which
    happens only when a backend did not enforce the regex or a limit cut it short.
    """
    if dtype in (None, "str"):
        return text
    value = text.strip()
    try:
        if dtype == "int":
            return int(value)
        if dtype == "float":
            return float(value)
        if dtype == "bool" and value in ("True", "False"):
            return value == "True"
    except ValueError:
        pass
    raise ValueError(f"a gen with dtype={dtype} produced {text!r}, which is not a {dtype}")
