"""OpenAI's Responses API (`POST /v1/responses`) read as a chat request: the body's model,
and its translation (`to_chat`) into the `ChatCompletionRequest` that `chat_call` builds,
so a response is generated exactly as the same conversation's chat completion.

What maps where: `instructions` is a first system message; `input` (a string, or items:
messages with text parts, the model's earlier `function_call`s and their
`function_call_output`s) the messages that follow, after the stored conversation of
`previous_response_id`; function `tools` and `tool_choice` their chat forms;
`text.format` is `response_format`; `max_output_tokens` is `max_completion_tokens`;
`reasoning.effort` is `reasoning_effort`; `top_logprobs` with
`include: ["message.output_text.logprobs"]` asks for logprobs. A reasoning item's text
(`content` parts of type `reasoning_text`, as this server writes them) is the
`reasoning_content` of the assistant turn right after it (a template decides what to
keep: gpt-oss's and Qwen3's keep a tool call's, drop earlier turns'); otherwise it is
dropped. Errors name the Responses field (`input[2].content[0].type`, `text.format`),
never the chat field behind it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.protocol import MAX_TOP_LOGPROBS, ChatCompletionRequest, _Body

LOGPROBS_INCLUDE = "message.output_text.logprobs"
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# chat field (as an error names it) -> the Responses field it came from
_FIELDS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
           "reasoning_effort": "reasoning.effort"}


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    """The body of `POST /v1/responses`: OpenAI's fields, plus the sampling extensions
    `/v1/chat/completions` takes (`seed`, `top_k`, `min_p`, penalties, `stop`)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    thinking_budget: int | None = Field(None, ge=0)  # as on /v1/chat/completions (server.thinking_budget)
    thinking_token_budget: int | None = Field(None, ge=0)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request `req` means, after the conversation items `history` (a stored
    response's input and output, `previous_response_id`). Raises ApiError naming the
    Responses field."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += input_messages(history, "previous_response_id") + input_messages(input_items(req), "input")
    if not messages:
        raise ApiError(400, "input must hold at least one message", "input")
    body: dict[str, Any] = {
        "model": req.model,  # it may name a LoRA adapter (`chat_call.adapter_of`)
        "messages": messages,
        "stream": req.stream,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "max_completion_tokens": req.max_output_tokens,
        "tools": None if req.tools is None else [_chat_tool(t, i) for i, t in enumerate(req.tools)],
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning is not None else None,
        **{k: getattr(req, k) for k in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                                        "presence_penalty", "frequency_penalty", "stop", "user",
                                        "thinking_budget", "thinking_token_budget")},
    }
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def renamed(e: ApiError) -> ApiError:
    """An error of the chat request behind a response, naming the Responses field."""
    for chat, ours in _FIELDS.items():
        if e.param == chat or e.message.startswith(chat):
            message = ours + e.message[len(chat):] if e.message.startswith(chat) else e.message
            return ApiError(e.status, message, ours.split(".")[0])
    return e


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) else req.input


def input_messages(items: list[Any], field: str) -> list[dict[str, Any]]:
    """Chat messages of Responses items: a message keeps its role (its parts' text
    joined), consecutive function calls join the assistant message before them, a call's
    output is a tool message, reasoning is the next assistant turn's `reasoning_content`."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None  # of the reasoning item just read
    for i, item in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", field)
        kind = item.get("type", "message")
        thought, reasoning = reasoning, None
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise ApiError(400, f"{where}.role must be one of {', '.join(INPUT_ROLES)}; got {role!r}", field)
            out.append({"role": role, "content": _content(item.get("content"), f"{where}.content", field)})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"] = thought
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where, field), "type": "function",
                    "function": {"name": _string(item, "name", where, field),
                                 "arguments": _string(item, "arguments", where, field)}}
            if out and out[-1]["role"] == "assistant" and not thought:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call],
                            **({"reasoning_content": thought} if thought else {})})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where, field),
                        "content": _text(item.get("output"), f"{where}.output", field)})
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not supported: input items are messages, function_call, "
                                "function_call_output and reasoning", field)
    return out


def _reasoning_text(item: dict[str, Any]) -> str | None:
    """The text of a reasoning item's `reasoning_text` parts (None without any); other
    parts (summaries, encrypted content) are not read."""
    parts = item.get("content")
    texts = [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
             and isinstance(p.get("text"), str)] if isinstance(parts, list) else []
    return "".join(texts) or None


def _content(content: Any, where: str, field: str) -> str | list[dict[str, Any]]:
    """A message's content for the chat request: its text (`_text`), or, when it holds
    `input_image` parts (`image_url`: a data URL, an http(s) URL, ...), chat parts in
    order: text parts and `image_url` parts."""
    if (not isinstance(content, list) or not all(isinstance(p, dict) for p in content)
            or not any(p.get("type") == "input_image" for p in content)):
        return _text(content, where, field)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.get("type") != "input_image":
            if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}[{j}] must be a text part ({' or '.join(TEXT_PARTS)}, with text) or "
                                    f"an input_image; got type {part.get('type')!r}", field)
            parts.append({"type": "text", "text": part["text"]})
            continue
        url = part.get("image_url")
        if not isinstance(url, str):
            raise ApiError(400, f"{where}[{j}].image_url must be a string (a file_id is not taken here)", field)
        detail = part.get("detail")
        parts.append({"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}})
    return parts


def _text(content: Any, where: str, field: str) -> str:
    """A message's content as text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", field)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}] must be a text part ({' or '.join(TEXT_PARTS)}, with text); "
                                f"got type {kind!r}: only text is read", field)
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", field)
    return value


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "parameters", ...}`) in
    the chat form."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ApiError(400, f"tools[{i}].type {kind!r} is not supported: only function tools run here "
                            "(the server has no built-in tools)", "tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ApiError(400, f"tools[{i}].name must be a non-empty string", "tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                       "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise ApiError(400, "text.format: a json_schema format needs a schema", "text")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}
