"""`Anthropic`: Anthropic's Messages API over HTTP (no `anthropic` package needed), as
SGLang's `sgl.Anthropic` backend: Anthropic's own service, or any server that speaks it
(`sprig serve` answers `/v1/messages`).

A gen sends the state's finished messages (the first system message as `system`; a state
without roles is one user message) and, when the gen comes after text in an open
`assistant()`, that text as the last assistant turn, which the answer continues
(Anthropic's prefill). `max_new_tokens` is `max_tokens` (128 when unset, SGLang's
default), `stop` `stop_sequences`, `json_schema` `output_config.format`; `temperature`,
`top_p` and `top_k` are sent when set. What the Messages API cannot express — `n > 1`,
`regex`/`dtype`, penalties, `min_p`, `seed`, `ignore_eos`, logprobs, `select` — raises
rather than being dropped. Images go as `image` blocks where they stood in their
message. Costs come from `usage` (prompt tokens: `input_tokens` plus the cache's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from sprig.backend.base import Backend, ChoiceLogprobs, Generation, Prompt, StreamChunk
from sprig.backend.http import HttpClient
from sprig.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from sprig.cost import Cost
from sprig.sampling import GenParams

API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 128
_PASSED = ("temperature", "top_p", "top_k")
_REFUSED = ("min_new_tokens", "stop_token_ids", "stop_regex", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty", "ignore_eos", "seed", "regex", "dtype", "return_logprob", "top_logprobs_num")


def _meta(answer: dict[str, Any], stop_reason: str | None) -> dict[str, Any]:
    """meta_info counts of a Messages answer's `usage`."""
    usage = answer.get("usage") or {}
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = (usage.get("input_tokens") or 0) + cached + (usage.get("cache_creation_input_tokens") or 0)
    return {"id": answer.get("id"), "prompt_tokens": prompt, "completion_tokens": usage.get("output_tokens") or 0,
            "cached_tokens": cached, "finish_reason": stop_reason}


def _block(part: dict[str, Any]) -> dict[str, Any]:
    """A chat content part as a Messages content block."""
    if part.get("type") != "image_url":
        return {"type": "text", "text": part["text"]}
    url = part["image_url"]["url"]
    if url.startswith("data:"):
        media, _, data = url[len("data:"):].partition(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    return {"type": "image", "source": {"type": "url", "url": url}}


def _message(message: dict[str, Any]) -> dict[str, Any]:
    content = message["content"]
    return {"role": message["role"], "content": content if isinstance(content, str) else [_block(p) for p in content]}


class Anthropic(Backend):
    """`model` served at `base_url` (the server's root: the API's paths start with
    `/v1`). `api_key` defaults to `ANTHROPIC_API_KEY`; it goes as `x-api-key`."""

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.anthropic.com",
        api_key: str | None = None,
        *,
        chat_template: ChatTemplate | str | None = None,
        timeout: float | None = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.model = model
        key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY")
        headers = {"anthropic-version": API_VERSION, **({"x-api-key": key} if key else {})}
        self.http = HttpClient(base_url, timeout=timeout, transport=transport, headers=headers)
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template_by_model_path(model)

    def get_model_name(self) -> str:
        return self.model

    def _request(self, prompt: Prompt, params: GenParams) -> dict[str, Any]:
        params = params.resolve_dtype()
        refused = [name for name in _REFUSED if getattr(params, name) not in (None, False)]
        if params.n not in (None, 1):
            refused.insert(0, "n")
        if refused:
            raise ValueError(f"the Anthropic Messages API cannot take {', '.join(refused)}: use a RuntimeEndpoint "
                             "(or OpenAI) backend for them")
        if prompt.uses_roles and prompt.open_role not in (None, "assistant"):
            raise ValueError("with the Anthropic Messages API a gen must come inside assistant(): the server "
                             "writes the assistant's turn")
        messages = [_message(m) for m in prompt.messages] if prompt.uses_roles else [
            {"role": "user", "content": prompt.text}]
        body: dict[str, Any] = {"model": self.model}
        if messages and messages[0]["role"] == "system":
            system = messages.pop(0)["content"]
            body["system"] = system if isinstance(system, str) else [b for b in system if b["type"] == "text"]
        if prompt.open_role == "assistant" and prompt.open_role_text:
            messages.append({"role": "assistant", "content": prompt.open_role_text})
        body["messages"] = messages
        body["max_tokens"] = params.max_new_tokens if params.max_new_tokens is not None else DEFAULT_MAX_TOKENS
        body.update({k: getattr(params, k) for k in _PASSED if getattr(params, k) is not None})
        if params.stop:
            body["stop_sequences"] = list(params.stop)
        if params.json_schema is not None:
            body["output_config"] = {"format": {"type": "json_schema", "schema": json.loads(params.json_schema)}}
        return body

    def generate(self, prompt: Prompt, params: GenParams) -> Generation:
        answer, waited = self.http.post("/v1/messages", self._request(prompt, params))
        text = "".join(b.get("text", "") for b in answer.get("content") or () if b.get("type") == "text")
        meta = _meta(answer, answer.get("stop_reason"))
        return Generation(text, meta, Cost.of_call(meta, waited))

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[StreamChunk]:
        body = {**self._request(prompt, params), "stream": True}
        message: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        stop = None
        for event, waited in self.http.stream("/v1/messages", body):
            kind, piece = event.get("type"), ""
            if kind == "message_start":
                message = event.get("message") or {}
                usage = dict(message.get("usage") or {})
            elif kind == "content_block_delta" and (event.get("delta") or {}).get("type") == "text_delta":
                piece = event["delta"].get("text", "")
            elif kind == "message_delta":
                usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
                stop = (event.get("delta") or {}).get("stop_reason")
            meta = _meta({"id": message.get("id"), "usage": usage}, stop)
            yield StreamChunk(piece, meta, Cost.of_call(meta, waited))

    def score_choices(self, prompt: Prompt, choices: Sequence[str], unconditional: bool) -> ChoiceLogprobs:
        raise NotImplementedError("select needs prompt logprobs, which the Anthropic Messages API does not give: "
                                  "use a RuntimeEndpoint (or OpenAI /completions) backend")
