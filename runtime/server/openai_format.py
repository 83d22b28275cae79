"""Between OpenAI's request/response shapes and SGLang's: sampling parameters in, and
choices, logprobs and usage out. Pure functions over dicts; the routes do the I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sprig.runtime.server.constraints import Constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sprig.runtime.wire import DetokenizedOutput

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


def finish_reason(reason: dict[str, Any] | None) -> tuple[str | None, Any]:
    """OpenAI's finish_reason ("stop", "length", "abort" or None) and what matched, from
    SGLang's finish_reason."""
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


@dataclass(frozen=True)
class Piece:
    """What a choice adds: text, the logprob triples `[logprob, id, text]` of the output
    tokens (and of the prompt's, when they arrive) with their top lists, and the finish
    reason once it ends. A stream's pieces are the outputs as they arrive
    (`of_outputs`); an answer sent whole is one piece (`of_response`)."""

    text: str
    output: list[list[Any]]
    output_top: list[Any]
    input: list[list[Any]]
    input_top: list[Any]
    finish: dict[str, Any] | None

    @classmethod
    def of_outputs(cls, outs: list[DetokenizedOutput]) -> Piece:
        inputs = next((o for o in outs if o.input_logprobs is not None), None)
        return cls(
            text="".join(o.text_delta for o in outs),
            output=[e for o in outs for e in o.output_logprobs],
            output_top=[t for o in outs for t in o.output_top_logprobs],
            input=[] if inputs is None else inputs.input_logprobs,
            input_top=[] if inputs is None else inputs.input_top_logprobs or [],
            finish=outs[-1].finish_reason,
        )

    @classmethod
    def of_response(cls, response: dict[str, Any]) -> Piece:
        meta = response["meta_info"]
        return cls(response["text"], meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", []),
                   meta.get("input_token_logprobs", []), meta.get("input_top_logprobs", []), meta["finish_reason"])

    def entries(self, *, with_input: bool) -> tuple[list[list[Any]], list[Any]]:
        """Logprob triples and their top lists (None where there is none): the input's
        (when `with_input`) then the output's."""
        entries, tops = list(self.output), list(self.output_top)
        if with_input:
            entries = self.input + entries
            tops = self.input_top + [None] * (len(self.input) - len(self.input_top)) + tops
        return entries, tops + [None] * (len(entries) - len(tops))


def usage(responses: list[dict[str, Any]], n: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Token counts of a call: each prompt counted once (its first sample's counts),
    every completion counted. `completion_tokens_details` holds `reasoning_tokens` when
    given (the completions' reasoning, split off by a reasoning parser) and, with
    speculative decoding, how many drafted tokens were kept and how many rejected, in
    OpenAI's names for predicted tokens (as SGLang reports them; rejected ones are not in
    the completion)."""
    metas = [r["meta_info"] for r in responses]
    firsts = metas[::n]
    prompt = sum(m["prompt_tokens"] for m in firsts)
    completion = sum(m["completion_tokens"] for m in metas)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(m["cached_tokens"] for m in firsts)},
    }
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if any("spec_num_proposed_drafts" in m for m in metas):
        kept = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
        drafted = sum(m.get("spec_num_proposed_drafts", 0) for m in metas)
        details.update(accepted_prediction_tokens=kept, rejected_prediction_tokens=drafted - kept)
    if details:
        out["completion_tokens_details"] = details
    return out


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
