"""Turning validated request bodies into `GenerateReq`s: tokenize (chat templates
included), check every limit the HTTP process can check, expand `n`. Every problem is a
400 `ApiError` naming it, raised before anything reaches the scheduler.

Cheap checks come before expensive work: a text is refused unread when it is longer than
any text of `context_len` tokens can be (`max_text_bytes`), and a list of ids when it is
longer than the context, before its values are scanned. The routes call these methods
off the event loop (`app.prepare`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sprig.runtime import json_limits
from sprig.runtime.generate_input import expand, ids_batch, params_per_prompt, rids_per_prompt
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.server.chat_render import ChatRenderer
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import ChatMessage
from sprig.runtime.wire import GenerateReq


@dataclass(frozen=True)
class LogprobArgs:
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers: the longest token
    string's (byte-level and byte-fallback spellings only make it larger)."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)


class InputBuilder:
    """Knows the tokenizer, the chat template and the model's limits (`context_len`,
    `vocab_size`, reported by the scheduler at startup)."""

    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int, chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja file to use instead of the tokenizer's template.
        Raises `ValueError` if the template does not compile, `OSError` if the file
        cannot be read."""
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        # Unicode normalization can shrink text up to 4x (a 4-byte character to 1 byte)
        self.max_text_bytes = 4 * context_len * max_token_bytes(tokenizer)
        self.chat = ChatRenderer.for_model(tokenizer, chat_template, self.max_text_bytes)

    @staticmethod
    def new_rid() -> str:
        """A request id no client can guess (ids are what `/abort_request` takes)."""
        return uuid.uuid4().hex

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str, *, add_special_tokens: bool = True, param: str = "text") -> list[int]:
        if not text:
            raise ApiError(400, f"{param} must not be empty", param)
        if len(text) > self.max_text_bytes or len(text.encode("utf-8")) > self.max_text_bytes:
            raise ApiError(400, f"{param} is longer than any text of the model's context length "
                                f"({self.context_len} tokens)", param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # e.g. text the tokenizer cannot represent
            raise ApiError(400, f"cannot tokenize {param}: {e}", param) from None

    def prompts(self, text: Any, input_ids: Any, param: str = "text") -> tuple[bool, list[list[int]]]:
        """(is_batch, token ids per prompt) from exactly one of `text` and `input_ids`."""
        if (text is None) == (input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", param)
        if text is not None:
            texts = [text] if isinstance(text, str) else text
            if not texts:
                raise ApiError(400, f"{param} must not be an empty list", param)
            return not isinstance(text, str), [self.encode(t, param=param) for t in texts]
        try:
            batch, rows = ids_batch(input_ids)
        except ValueError as e:
            raise ApiError(400, str(e), "input_ids") from None
        for row in rows:
            if not row:
                raise ApiError(400, "input_ids must not contain an empty prompt", "input_ids")
            if len(row) >= self.context_len:
                raise ApiError(400, f"a prompt of input_ids has {len(row)} tokens; the model's context length is "
                                    f"{self.context_len}", "input_ids")
            if bad := [t for t in row if not 0 <= t < self.vocab_size]:
                raise ApiError(400, f"input_ids has token ids outside [0, {self.vocab_size}): {bad[:5]}", "input_ids")
        return batch, rows

    def chat_text(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None, **render: bool) -> str:
        """The chat template rendered (`render`: `ChatRenderer.render`'s options), to be
        tokenized without adding special tokens (the template places them). An assistant's
        tool calls reach the template with their arguments as an object, as templates
        expect (`_call_for_template`)."""
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template)", "messages")
        rendered = []
        for m in messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = [_call_for_template(c) for c in m.tool_calls]
            rendered.append(msg)
        try:
            return self.chat.render(rendered, tools, template_kwargs, **render)
        except ValueError as e:  # a role or field the template rejects, a reserved variable, too long
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise ApiError(400, str(e), param) from None

    # ------------------------------------------------------------------ requests
    def params(self, arg: Any, n_prompts: int) -> list[SamplingParams]:
        try:
            params = params_per_prompt(arg, n_prompts)
            for p in params:
                p.validate_for_model(self.vocab_size)
        except ValueError as e:
            raise ApiError(400, str(e), "sampling_params") from None
        return params

    def requests(self, prompts: list[list[int]], params: list[SamplingParams], rid: Any,
                 logprobs: LogprobArgs, *, stream: bool) -> list[GenerateReq]:
        """One `GenerateReq` per sequence (n per prompt, in output order), with every
        length limit checked. Only a `stream`ed request's text is decoded step by step."""
        for ids, p in zip(prompts, params, strict=True):
            self.check_length(len(ids), p.max_new_tokens)
        if logprobs.top_logprobs_num > self.vocab_size:
            raise ApiError(400, f"top_logprobs_num must be <= {self.vocab_size}", "top_logprobs_num")
        try:
            rids = rids_per_prompt(rid, len(prompts), self.new_rid)
        except ValueError as e:
            raise ApiError(400, str(e), "rid") from None
        try:
            seqs = expand(rids, prompts, params)
        except ValueError as e:  # a seed + sample index out of range
            raise ApiError(400, str(e), "sampling_params") from None
        return [
            GenerateReq(
                rid=s.rid,
                prompt_ids=s.prompt_ids,
                sampling_params=s.params.to_dict(),
                return_logprob=logprobs.return_logprob,
                logprob_start_len=logprobs.logprob_start_len,
                top_logprobs_num=logprobs.top_logprobs_num,
                return_text_in_logprobs=logprobs.return_text_in_logprobs,
                stream=stream,
            )
            for s in seqs
        ]

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len >= self.context_len:
            raise ApiError(
                400, f"the prompt has {prompt_len} tokens; the model's context length is {self.context_len}"
            )
        if prompt_len + max_new_tokens > self.context_len:
            raise ApiError(
                400,
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context length {self.context_len}",
                "max_new_tokens",
            )

    def room(self, prompt_len: int) -> int:
        """The most tokens a prompt of this length can still generate."""
        return max(self.context_len - prompt_len, 0)


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: OpenAI sends `function.arguments` as
    JSON text, while templates (Qwen2.5, Llama 3.1, ...) write `arguments | tojson`, which
    would quote that text once more. Arguments that are not a JSON object stay as sent."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json_limits.loads(fn["arguments"], "tool call arguments")
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
