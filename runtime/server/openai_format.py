"""Between OpenAI's request/response shapes and SGLang's: sampling parameters in, and
choices, logprobs and usage out. Pure functions over dicts; the routes do the I/O."""

from __future__ import annotations

from typing import Any

from sprig.runtime.server.constraints import Constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

# SGLang sampling parameter <- OpenAI request field (None values are left out)
_RENAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "stop_regex": "stop_regex",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "seed": "seed",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_new_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "no_stop_trim",
}


def sampling_dict(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int,
                  constraint: Constraint | None) -> dict[str, Any]:
    """The `sampling_params` an OpenAI request means, its `constraint` (what
    `constraints.request_constraint` found in it) included."""
    d: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for ours, theirs in _RENAMES.items():
        value = getattr(req, theirs)
        if value is not None:
            d[ours] = value
    if req.include_stop_str_in_output is not None:
        if req.no_stop_trim is not None:
            raise ApiError(400, "give no_stop_trim or include_stop_str_in_output, not both",
                           "include_stop_str_in_output")
        d["no_stop_trim"] = req.include_stop_str_in_output
    if constraint is not None:
        d[constraint.key] = constraint.value
    return d


def finish_reason(response: dict[str, Any]) -> tuple[str | None, Any]:
    """OpenAI's finish_reason ("stop", "length", "abort" or None) and what matched."""
    fr = response["meta_info"]["finish_reason"]
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def usage(responses: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Token counts of a call: each prompt counted once (its first sample's counts),
    every completion counted."""
    firsts = [r["meta_info"] for r in responses[::n]]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(r["meta_info"]["completion_tokens"] for r in responses)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }


def token_entries(meta: dict[str, Any], start: int, *, with_input: bool) -> tuple[list[list[Any]], list[Any]]:
    """Logprob triples `[logprob, id, text]` and their top lists: the input's (when
    `with_input`) then the output's from index `start` on."""
    entries = list(meta.get("output_token_logprobs", []))[start:]
    tops = list(meta.get("output_top_logprobs", []))[start:]
    if with_input:
        entries = list(meta.get("input_token_logprobs", [])) + entries
        inputs = list(meta.get("input_top_logprobs", []))
        tops = inputs + [None] * (len(meta.get("input_token_logprobs", [])) - len(inputs)) + tops
    return entries, tops + [None] * (len(entries) - len(tops))


def completion_logprobs(entries: list[list[Any]], tops: list[Any], offset: int, text: str,
                        special_ids: frozenset[int]) -> tuple[dict[str, Any], int]:
    """The legacy completions `logprobs` object of the tokens that make `text`, whose first
    character is at `offset` of the choice's text; and the offset after them. A special
    token whose text is not there (the BOS a tokenizer adds to a prompt) takes no room."""
    texts = [e[2] or "" for e in entries]
    offsets, at = [], 0
    for e, t in zip(entries, texts, strict=True):
        offsets.append(offset + at)
        if e[1] not in special_ids or text.startswith(t, at):
            at += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [e[0] for e in entries],
        "top_logprobs": [None if top is None else {t[2] or "": t[0] for t in top} for top in tops],
        "text_offset": offsets,
    }, offset + at


def chat_logprobs(entries: list[list[Any]], tops: list[Any]) -> dict[str, Any]:
    def item(e: list[Any]) -> dict[str, Any]:
        text = e[2] or ""
        return {"token": text, "logprob": e[0], "bytes": list(text.encode("utf-8"))}

    return {"content": [item(e) | {"top_logprobs": [item(t) for t in top or []]} for e, top in zip(entries, tops, strict=True)]}
