"""Turning parsed request bodies into `TokenizedRequest`s: tokenize (chat templates
included), then the request contract (`runtime/request_contract.py` `build_requests`:
every check, `n` expanded). Every problem is a 400 `ApiError` naming the field, raised
before anything reaches the scheduler.

Cheap checks come before expensive work: a text is refused unread when it is longer than
any text of `context_len` tokens can be (`max_text_bytes`), and a list of ids when it is
longer than the context, before its values are scanned. The routes call these methods
off the event loop (`http_io.prepare`)."""

from __future__ import annotations

import uuid
from typing import Any

from sprig.runtime import json_limits
from sprig.runtime.multimodal.inputs import TEXT_ONLY, ImageInput
from sprig.runtime.multimodal.prompts import IMAGE_FIELD, ImagePrompter, prompts_with_images
from sprig.runtime.request_contract import (
    PRIORITY_OFF,
    InvalidRequest,
    LogprobOptions,
    ModelLimits,
    SamplingArg,
    TokenizedRequest,
    build_requests,
    check_prompt,
    prompt_rows,
)
from sprig.runtime.server.chat_render import ChatRenderer
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.protocol import ChatMessage, ImagePart


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers: the longest token
    string's (byte-level and byte-fallback spellings only make it larger)."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=1)


class RequestBuilder:
    """Knows the tokenizer, the chat template and the model's limits (`context_len`,
    `vocab_size`, reported by the scheduler at startup), and whether the scheduler takes
    requests' priorities."""

    def __init__(self, tokenizer: Any, context_len: int, vocab_size: int, chat_template: str | None = None, *,
                 priority_scheduling: bool = False, images: ImagePrompter | None = None,
                 no_images: str = TEXT_ONLY) -> None:
        """`chat_template`: a Jinja file to use instead of the tokenizer's template.
        `images`: how prompts take images, for a model that takes them; else `no_images`
        says why a request with images is refused. Raises `ValueError` if the template
        does not compile, `OSError` if the file cannot be read."""
        self.priority_scheduling = priority_scheduling
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.images = images
        self.no_images = no_images
        self.limits = ModelLimits(context_len, vocab_size, None if images is None else images.spec.token_id)
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
        """(is_batch, token ids per prompt) from exactly one of `text` and `input_ids`;
        the ids are checked with the rest of the request (`requests`)."""
        try:
            return prompt_rows(text, input_ids, lambda t: self.encode(t, param=param), text_field=param)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None

    def prompt_text(self, ids: list[int], param: str) -> str:
        """The text of the prompt `ids`, checked first as `requests` checks it (a 400 naming
        `param` for ids outside the vocabulary), so nothing undecodable is decoded."""
        try:
            check_prompt(ids, self.limits, param)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None
        return self.tokenizer.decode(ids)

    def image_prompts(self, text: Any, input_ids: Any, image_data: Any,
                      param: str = "text") -> tuple[bool, list[list[int]], list[tuple[ImageInput, ...]] | None]:
        """`prompts`, each with its images from SGLang's `image_data`
        (`multimodal.prompts.prompts_with_images`; None: no images, and None back)."""
        if image_data is None:
            return *self.prompts(text, input_ids, param), None
        if self.images is None:
            raise ApiError(400, self.no_images, IMAGE_FIELD)
        try:
            return prompts_with_images(self.images, text, input_ids, image_data,
                                       lambda t: self.encode(t, param=param), param=param)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None

    def with_images(self, prompt: str | list[int], sources: list[Any], *, param: str, field: str = IMAGE_FIELD,
                    add_special_tokens: bool = True) -> tuple[list[int], tuple[ImageInput, ...]]:
        """One prompt (a text or ids) with its image placeholders expanded and its images
        loaded and processed (`ImagePrompter`; the cheap checks first)."""
        if self.images is None:
            raise ApiError(400, self.no_images, field)
        try:
            return self.images.prompt(prompt, sources,
                                      lambda t: self.encode(t, add_special_tokens=add_special_tokens, param=param),
                                      param=param, field=field)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None

    def chat_text(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None, **render: bool) -> str:
        """The chat template rendered (`render`: `ChatRenderer.render`'s options), to be
        tokenized without adding special tokens (the template places them). An assistant's
        tool calls reach the template with their arguments as an object, as templates
        expect (`_call_for_template`), and with content "" rather than null (templates test
        it with `in`); its reasoning (`reasoning_content`, or vLLM's `reasoning`) as
        `reasoning_content` (Qwen3's templates read it) and `thinking` (gpt-oss's)."""
        if self.chat is None:
            raise ApiError(400, "this model has no chat template (start the server with --chat-template)", "messages")
        if self.images is None:
            for i, m in enumerate(messages):
                for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                    if isinstance(part, ImagePart):
                        raise ApiError(400, f"messages[{i}].content[{j}]: {self.no_images}", "messages")
        rendered = []
        for m in messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
            for key in ("name", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = [_call_for_template(c) for c in m.tool_calls]
                msg["content"] = "" if msg["content"] is None else msg["content"]
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None and m.role == "assistant":
                msg["reasoning_content"] = msg["thinking"] = reasoning
            rendered.append(msg)
        try:
            return self.chat.render(rendered, tools, template_kwargs, **render)
        except ValueError as e:  # a role or field the template rejects, a reserved variable, too long
            param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
            raise ApiError(400, str(e), param) from None

    @staticmethod
    def chat_images(messages: list[ChatMessage]) -> list[str]:
        """The URLs of the messages' image parts, in order."""
        return [p.image_url.url for m in messages if isinstance(m.content, list)
                for p in m.content if isinstance(p, ImagePart)]

    # ------------------------------------------------------------------ requests
    @staticmethod
    def logprob_options(prompts: int, *options: Any) -> list[LogprobOptions]:
        """`LogprobOptions.per_prompt`, its `InvalidRequest` as a 400 naming the field."""
        try:
            return LogprobOptions.per_prompt(prompts, *options)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None

    def requests(self, prompts: list[list[int]], sampling: SamplingArg, rid: Any,
                 logprobs: LogprobOptions | list[LogprobOptions], *,
                 stream: bool, prompt_field: str = "input_ids", priority: int | None = None,
                 lora_path: Any = None, images: list[tuple[ImageInput, ...]] | None = None) -> list[TokenizedRequest]:
        """One `TokenizedRequest` per sequence (n per prompt, in output order): the request
        contract's `build_requests`, its `InvalidRequest` as a 400 naming the field. A
        `priority` is a 400 unless the scheduler schedules by it."""
        if priority is not None and not self.priority_scheduling:
            raise ApiError(400, PRIORITY_OFF, "priority")
        try:
            return build_requests(prompts, sampling, self.limits, rid=rid, new_rid=self.new_rid,
                                  logprobs=logprobs, stream=stream, prompt_field=prompt_field, priority=priority,
                                  lora_path=lora_path, images=images)
        except InvalidRequest as e:
            raise ApiError(400, str(e), e.field) from None

    def room(self, prompt_len: int) -> int:
        """The most tokens a prompt of this length can still generate."""
        return max(self.context_len - prompt_len, 0)


def _content(m: ChatMessage) -> str | list[dict[str, str]] | None:
    """A message's content as chat templates read it: a string, or, when it holds images,
    its parts in order (`{"type": "text", "text": ...}` and `{"type": "image"}`, as
    transformers' processors pass them; a vision model's template writes its image
    placeholder for each)."""
    if m.content is None or isinstance(m.content, str):
        return m.content
    if not any(isinstance(p, ImagePart) for p in m.content):
        return "".join(p.text for p in m.content)
    return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in m.content]


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
