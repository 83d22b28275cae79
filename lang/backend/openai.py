"""`OpenAI`: any OpenAI-compatible server over HTTP (no `openai` package needed).

A gen goes to `/chat/completions` when the program uses roles — it must then come right
after `assistant` begins, and the finished messages are sent — and to `/completions`
with the state's text otherwise. Parameters beyond OpenAI's (`top_k`, `min_p`, `regex`,
`ignore_eos`, ...) are sent only when set, as the extra fields SGLang and vLLM accept;
`json_schema` becomes `response_format`. `select` needs prompt logprobs, which only
`/completions` gives (`echo` with `logprobs` and `max_tokens: 0`); on a chat-formatted
state it raises `NotImplementedError`. Costs come from `usage`.

Images (`sgl.image`) go only through the chat API: each as an `image_url` content part
(a data URL of the file, or the URL the program gave) where it stood in its message,
the image token's text left out. A state with an image outside every role is an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from sprig.backend.base import Backend, ChoiceLogprobs, Generation, Prompt, StreamChunk
from sprig.backend.http import HttpClient
from sprig.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from sprig.cost import Cost
from sprig.sampling import GenParams

_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_PASSED = ("n", "temperature", "top_p", "frequency_penalty", "presence_penalty", "top_k", "min_p",
           "repetition_penalty", "ignore_eos", "regex", "stop_token_ids", "stop_regex", "seed")


def _usage_meta(answer: dict[str, Any]) -> dict[str, Any]:
    """The `meta_info` counts an OpenAI `usage` holds (drafted tokens kept and rejected,
    where a speculating server reports them as predicted tokens)."""
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    drafts = usage.get("completion_tokens_details") or {}
    kept, rejected = drafts.get("accepted_prediction_tokens") or 0, drafts.get("rejected_prediction_tokens") or 0
    meta = {
        "id": answer.get("id"),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": details.get("cached_tokens") or 0,
    }
    if kept or rejected:
        meta.update(spec_num_correct_drafts=kept, spec_num_proposed_drafts=kept + rejected)
    return meta


def _output_logprobs(choice: dict[str, Any]) -> list[list[Any]]:
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:  # chat format
        return [[t["logprob"], None, t["token"]] for t in logprobs["content"] or []]
    return [[lp, None, tok] for lp, tok in zip(logprobs.get("token_logprobs", []), logprobs.get("tokens", []), strict=True)]


def _refuse_images(prompt: Prompt) -> None:
    """A `/completions` request takes text only."""
    if prompt.images:
        raise ValueError(
            "an OpenAI-compatible server takes images through the chat API only: put sgl.image "
            "inside a role, e.g. sgl.user(sgl.image(path) + 'question'), and gen inside assistant()"
        )


def _check_images_in_messages(prompt: Prompt) -> None:
    """Every image of the state must sit in a message (none before the first role)."""
    sent = sum(
        part.get("type") == "image_url"
        for message in prompt.messages if isinstance(message["content"], list)
        for part in message["content"]
    )
    if sent != len(prompt.images):
        raise ValueError(
            f"{len(prompt.images) - sent} image(s) of the program stand outside every role; the chat "
            "API sends images inside messages: put sgl.image inside a role, e.g. sgl.user(...)"
        )


class OpenAI(Backend):
    """`model` served at `base_url` (which includes `/v1`)."""

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        *,
        chat_template: ChatTemplate | str | None = None,
        timeout: float | None = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.model = model
        self.http = HttpClient(base_url, api_key, timeout=timeout, transport=transport)
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template_by_model_path(model)

    def get_model_name(self) -> str:
        return self.model

    def _request(self, prompt: Prompt, params: GenParams) -> tuple[str, dict[str, Any]]:
        params = params.resolve_dtype()
        body: dict[str, Any] = {"model": self.model}
        if prompt.uses_roles:
            if prompt.open_role != "assistant" or prompt.open_role_text.strip():
                raise ValueError(
                    "with an OpenAI chat endpoint a gen must come right after assistant() "
                    "begins: the server writes the whole assistant message"
                )
            path, chat = "/chat/completions", True
            body["messages"] = list(prompt.messages)
            _check_images_in_messages(prompt)
        else:
            _refuse_images(prompt)
            path, chat = "/completions", False
            body["prompt"] = prompt.text
        for name, key in _RENAMED.items():
            if getattr(params, name) is not None:
                body[key] = getattr(params, name)
        body.update({k: getattr(params, k) for k in _PASSED if getattr(params, k) is not None})
        if params.stop:
            body["stop"] = list(params.stop)
        if params.json_schema is not None:
            schema = {"name": "output", "schema": json.loads(params.json_schema)}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if params.return_logprob:
            top = params.top_logprobs_num or 0
            body.update({"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top})
        return path, body

    @staticmethod
    def _text(choice: dict[str, Any]) -> str:
        if "message" in choice:
            return choice["message"].get("content") or ""
        if "delta" in choice:
            return choice["delta"].get("content") or ""
        return choice.get("text") or ""

    def generate(self, prompt: Prompt, params: GenParams) -> Generation:
        path, body = self._request(prompt, params)
        answer, waited = self.http.post(path, body)
        usage = _usage_meta(answer)
        choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
        metas = tuple(
            {**usage, "finish_reason": c.get("finish_reason"), "output_token_logprobs": _output_logprobs(c)}
            for c in choices
        )
        cost = Cost.of_call(usage, waited)
        if len(choices) == 1:
            return Generation(self._text(choices[0]), metas[0], cost)
        return Generation(tuple(self._text(c) for c in choices), metas, cost)

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[StreamChunk]:
        path, body = self._request(prompt, params)
        body.update(stream=True, stream_options={"include_usage": True})
        meta: dict[str, Any] = {}
        for event, waited in self.http.stream(path, body):
            if event.get("usage"):
                meta = _usage_meta(event)
            choices = event.get("choices") or []
            piece = self._text(choices[0]) if choices else ""
            if choices and choices[0].get("finish_reason"):
                meta = {**meta, "finish_reason": choices[0]["finish_reason"]}
            yield StreamChunk(piece, meta, Cost.of_call(meta, waited))

    def score_choices(self, prompt: Prompt, choices: Sequence[str], unconditional: bool) -> ChoiceLogprobs:
        if prompt.uses_roles:
            raise NotImplementedError(
                "select on an OpenAI-compatible backend needs prompt logprobs, which only "
                "/completions gives (echo + logprobs); a chat-formatted state cannot be scored"
            )
        _refuse_images(prompt)
        conditional, cost = self._echo([prompt.text + c for c in choices], len(prompt.text))
        if not unconditional:
            return ChoiceLogprobs(conditional, None, cost)
        alone, more = self._echo(list(choices), 0)
        return ChoiceLogprobs(conditional, alone, cost + more)

    def _echo(self, texts: list[str], start: int) -> tuple[list[list[Any]], Cost]:
        """Prompt logprobs of each text, restricted to tokens that end after `start`."""
        answer, waited = self.http.post("/completions", {
            "model": self.model, "prompt": texts, "max_tokens": 0, "echo": True, "logprobs": 0,
            "temperature": 0,
        })
        out = []
        for choice in sorted(answer["choices"], key=lambda c: c.get("index", 0)):
            lp = choice["logprobs"]
            rows = zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"], strict=True)
            out.append([[logprob, None, tok] for tok, logprob, at in rows if at + len(tok) > start])
        return out, Cost.of_call(_usage_meta(answer), waited)
