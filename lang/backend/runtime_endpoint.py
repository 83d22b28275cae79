"""`RuntimeEndpoint`: a sprig or SGLang server through its native `/generate` API.

What the server must provide:
- `GET /get_model_info` -> `{"model_path": str, ...}`; for chat programs also either
  `chat_roles` ({role: [prefix, suffix]} for system/user/assistant) with
  `default_system_prompt` and `stop_str`, or `chat_template` (the tokenizer's Jinja
  source) with `bos_token` — see `sprig.template_source` for the order of preference;
- `POST /generate` with SGLang's schema, including batched `text` lists, `input_ids`,
  `max_new_tokens: 0`, `return_logprob` / `logprob_start_len` /
  `return_text_in_logprobs` (input_token_logprobs entries `[logprob, id, text]`), SSE
  streaming, and `meta_info.prompt_tokens` / `completion_tokens` / `cached_tokens` /
  `e2e_latency`;
- `POST /flush_cache`, `GET /get_server_info` (or `/server_info`), `GET /health`.

Requests (all `POST /generate`):
- gen: `{"text", "sampling_params": <set fields>, <set logprob fields>}`; with `n > 1`
  the server answers a list, one response per sample;
- stream: the same with `"stream": true`; SSE events carry cumulative `text` and each
  event's new output logprob entries (`gather_logprobs` makes them cumulative);
- commit (a fork, and the first step of select): `{"text", "sampling_params":
  {"max_new_tokens": 0}}` — prefills the prefix into the radix cache and reports its
  token count as `meta_info.prompt_tokens`;
- select: after the commit, ONE batched request scores every choice: `text` is the list
  of prefix+choice, `max_new_tokens: 0`, `return_logprob`, `return_text_in_logprobs`,
  `logprob_start_len = prefix_tokens - 1`; `unconditional_likelihood_normalized` adds
  one more batched request on the choices' token ids alone (`input_ids`).

Images (`sgl.image`): every request whose text holds the state's image tokens carries
`"image_data"`, the state's images in order (each the base64 of the file's bytes, or the
URL the program gave): a list for one text, a list of such lists (one per text) for the
batched select. A state without images sends no `image_data` key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from sprig.backend.base import (
    STREAMED_LOGPROB_KEYS,
    Backend,
    ChoiceLogprobs,
    Generation,
    Prompt,
    StreamChunk,
)
from sprig.backend.http import HttpClient, ServerError
from sprig.chat_template import ChatTemplate
from sprig.choices import TokenEntry
from sprig.cost import Cost
from sprig.sampling import GenParams
from sprig.template_source import resolve_chat_template

_SCORE_PARAMS = {"max_new_tokens": 0, "temperature": 0}


def own_tokens(prefix: str, entries: Sequence[TokenEntry]) -> list[list[Any]]:
    """The entries of a choice's own tokens, from `input_token_logprobs` that start at
    the prefix's last token. That first entry is dropped when the prefix still ends with
    its text (the tokenization kept the boundary) and kept when the choice merged into
    it (token healing); leading entries without a logprob are dropped."""
    rows = [list(e) for e in entries]
    if prefix and rows and (rows[0][2] is None or prefix.endswith(rows[0][2])):
        rows = rows[1:]
    while rows and rows[0][0] is None:
        rows = rows[1:]
    return rows


def image_fields(prompt: Prompt, batch: int | None = None) -> dict[str, Any]:
    """`{"image_data": ...}` for a request on `prompt.text` (or, with `batch`, on that
    many texts that each extend it); empty when the prompt has no images."""
    if not prompt.images:
        return {}
    images = [image.data for image in prompt.images]
    return {"image_data": images if batch is None else [list(images) for _ in range(batch)]}


def gather_logprobs(gathered: dict[str, list[Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` of one streamed event with its output-side logprob lists made cumulative
    (`gathered` holds them so far and is extended). A sprig or current SGLang server
    sends each event's new entries with the cumulative count in
    `output_token_logprobs_length`; without that count the lists are taken as cumulative
    already (older servers)."""
    total = meta.get("output_token_logprobs_length")
    out = dict(meta)
    for key in STREAMED_LOGPROB_KEYS:
        if key not in meta:
            continue
        have, entries = gathered.setdefault(key, []), meta[key]
        new = len(entries) - len(have) if total is None else min(len(entries), total - len(have))
        have += entries[len(entries) - new :] if new > 0 else []
        out[key] = list(have)
    return out


class RuntimeEndpoint(Backend):
    """A server speaking SGLang's native API at `base_url`.

    The chat template comes from `chat_template` (a `ChatTemplate` or registered name)
    if given, else from `/get_model_info` (see `sprig.template_source`).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        chat_template: ChatTemplate | str | None = None,
        timeout: float | None = 600.0,
        transport: httpx.BaseTransport | None = None,
        verify: bool | str = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = HttpClient(self.base_url, api_key, timeout=timeout, transport=transport, verify=verify)
        self.model_info: dict[str, Any] = self.http.get("/get_model_info")
        self.chat_template = resolve_chat_template(self.model_info, chat_template)

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def close(self) -> None:
        self.http.close()

    def flush_cache(self) -> bool:
        self.http.post("/flush_cache", {})
        return True

    def get_server_info(self) -> dict[str, Any]:
        try:
            return self.http.get("/get_server_info")
        except ServerError as e:
            if e.status != 404:
                raise
            return self.http.get("/server_info")

    def cache_prefix(self, prefix: str) -> Cost:
        """Prefill `prefix` into the server's cache."""
        return self._commit(prefix)[1]

    def commit(self, prompt: Prompt) -> Cost:
        return self._commit(prompt.text, image_fields(prompt))[1]

    def _commit(self, text: str, fields: dict[str, Any] | None = None) -> tuple[dict[str, Any], Cost]:
        """Prefill `text`; `fields` are more of the request's fields (its `image_fields`)."""
        payload = {"text": text, "sampling_params": {"max_new_tokens": 0}, **(fields or {})}
        answer, waited = self.http.post("/generate", payload)
        return answer["meta_info"], Cost.of_call(answer["meta_info"], waited)

    @staticmethod
    def _payload(prompt: Prompt, params: GenParams) -> dict[str, Any]:
        return {"text": prompt.text, "sampling_params": params.to_native(), **params.logprob_fields(),
                **image_fields(prompt)}

    def generate(self, prompt: Prompt, params: GenParams) -> Generation:
        answer, waited = self.http.post("/generate", self._payload(prompt, params))
        if isinstance(answer, list):
            metas = tuple(a["meta_info"] for a in answer)
            return Generation(tuple(a["text"] for a in answer), metas, Cost.of_call(metas, waited))
        return Generation(answer["text"], answer["meta_info"], Cost.of_call(answer["meta_info"], waited))

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[StreamChunk]:
        sent = 0
        gathered: dict[str, list[Any]] = {}
        for event, waited in self.http.stream("/generate", {**self._payload(prompt, params), "stream": True}):
            text, meta = event["text"], gather_logprobs(gathered, event.get("meta_info", {}))
            yield StreamChunk(text[sent:], meta, Cost.of_call(meta, waited))
            sent = len(text)

    def score_choices(self, prompt: Prompt, choices: Sequence[str], unconditional: bool) -> ChoiceLogprobs:
        prefix = prompt.text
        prefix_tokens, cost = 0, Cost()
        if prefix:
            meta, cost = self._commit(prefix, image_fields(prompt))
            prefix_tokens = int(meta["prompt_tokens"])
        answers, waited = self.http.post("/generate", {
            "text": [prefix + c for c in choices],
            "sampling_params": dict(_SCORE_PARAMS),
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prefix_tokens - 1, 0),
            **image_fields(prompt, batch=len(choices)),
        })
        metas = [a["meta_info"] for a in answers]
        cost = cost + Cost.of_call(metas, waited)
        conditional = [own_tokens(prefix, m["input_token_logprobs"]) for m in metas]
        if not unconditional:
            return ChoiceLogprobs(conditional, None, cost)
        answers, waited = self.http.post("/generate", {
            "input_ids": [[e[1] for e in entries] for entries in conditional],
            "sampling_params": dict(_SCORE_PARAMS),
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
        })
        metas = [a["meta_info"] for a in answers]
        alone = [[list(e) for e in m["input_token_logprobs"]] for m in metas]
        return ChoiceLogprobs(conditional, alone, cost + Cost.of_call(metas, waited))
