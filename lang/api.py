"""The SGLang-compatible constructors a program uses: `gen`, `select`, `image`, roles, backends."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from sprig.backend.base import resolve_backend
from sprig.choices import ChoicesSamplingMethod, token_length_normalized
from sprig.ir import (
    Expr,
    ExprList,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    as_expr,
    generated_names,
)
from sprig.reasoning import reasoning_format
from sprig.sampling import GenParams


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> Gen | Select:
    """Generate text into variable `name`; unset arguments fall back to the run's
    defaults, then the server's. With `choices` this is `select`; with `dtype` (int,
    float, str, bool) the text is regex-constrained, and a number or bool is bound as
    that Python type (a str stays the text as generated, quotes included, as SGLang).
    `seed` (sent as SGLang's `sampling_seed`) makes a sampled gen reproducible: the same
    text, parameters and seed give the same output whatever else the server runs.
    `stop_regex` ends the gen where its text matches a pattern (trimmed like `stop`)."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None:
        re.compile(regex)
    return Gen(name, GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop,
        stop_token_ids=stop_token_ids, stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        ignore_eos=ignore_eos, seed=seed, regex=regex, json_schema=json_schema, dtype=dtype,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
    ))


def gen_int(name: str | None = None, **kwargs: Any) -> Gen | Select:
    """`gen(name, dtype=int, ...)`: an integer, bound as `int`."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen | Select:
    """`gen(name, dtype=str, ...)`: a double-quoted string, bound as generated."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Select:
    """Append the most likely of `choices` under `choices_method` and bind it to `name`.
    Selection scores likelihoods, so `temperature` must be 0."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select needs a non-empty list of non-empty strings; got {choices!r}")
    if temperature > 1e-5:
        raise ValueError("select picks the most likely choice; temperature must be 0")
    return Select(name, tuple(choices), choices_method)


def image(source: str | os.PathLike[str] | bytes) -> Image:
    """An image at this point of the prompt: `source` is a file path (read, and sent as
    base64, when the expression runs), an `http(s)://` or `data:` URL (sent as it is), or
    the image file's bytes. The prompt text gets the chat template's `image_token`; every
    later call of the state (and of its forks) sends the state's images, in order."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, (str, bytes)):
        raise TypeError(f"sgl.image takes a path, a URL or bytes, not {type(source).__name__}")
    return Image(source)


def separate_reasoning(expr: Expr, model_type: str | None = None) -> ExprList:
    """`expr` (a named gen or select, or several), then each one's output split into its
    reasoning, bound to `<name>_reasoning_content`, and its answer, bound to `<name>` and
    left in the text; `model_type` names the format (see `sprig.reasoning`)."""
    names = tuple(generated_names(expr))
    if not names:
        raise ValueError("separate_reasoning needs a named gen or select, e.g. gen('answer')")
    return expr + SeparateReasoning(names, reasoning_format(model_type))


def _role(role: str, expr: Expr | str | None) -> ExprList:
    if expr is None:
        return ExprList((RoleBegin(role), RoleEnd(role)))
    return RoleBegin(role) + as_expr(expr) + RoleEnd(role)


def system(expr: Expr | str | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def _server_call(backend: Any, method: str) -> Any:
    chosen = resolve_backend(backend)
    call = getattr(chosen, method, None)
    if call is None:
        raise NotImplementedError(f"{type(chosen).__name__} has no {method}")
    return call()


def flush_cache(backend: Any = None) -> Any:
    """Ask the backend's server to drop its prefix cache."""
    return _server_call(backend, "flush_cache")


def get_server_info(backend: Any = None) -> Any:
    return _server_call(backend, "get_server_info")
