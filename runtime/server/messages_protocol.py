"""Anthropic's Messages API (`POST /v1/messages`) read as a chat request: the body's
model, and its translation (`to_chat`) into the `ChatCompletionRequest` that `chat_call`
builds, so a message is generated exactly as the same conversation's chat completion.

What maps where: `system` (a string or text blocks) is a first system message; a user
turn's `text` and `image` blocks its content, its `tool_result` blocks tool messages
before it (a result's text blocks joined); an assistant turn's `text` blocks its content,
its `thinking` blocks its `reasoning_content` (a template decides what to keep), its
`tool_use` blocks its tool calls; `tools` (`input_schema`) are function tools, and
`tool_choice` `auto`/`any`/`tool`/`none` is "auto"/"required"/a named function/"none"
(`disable_parallel_tool_use` is `parallel_tool_calls: false`); `max_tokens` (required;
0 only fills the prefix cache, as Anthropic's pre-warming), `stop_sequences`, and the
sampling fields older clients send (`temperature`, `top_p`, `top_k`) keep their meaning;
`output_config.format` (a `json_schema`) is `response_format`, `output_config.effort`
`reasoning_effort` (`xhigh` and `max` read as `high`); `thinking` `disabled` renders the
template with `enable_thinking: false` (Qwen3's switch), `enabled` with it true, its
`budget_tokens` a thinking budget (`server.thinking_budget`) on a server with a
`--reasoning-parser` of think markers (elsewhere only `max_tokens` bounds it), `adaptive` and
`between_tools` leave the template's default. A conversation that ends in an assistant
turn is continued from it (prefill). Anthropic's server tools (`bash_...`,
`web_search_...`, `text_editor_...`), `document` blocks, MCP servers and a code-execution
`container` are refused: nothing runs here but the model; `cache_control` marks are accepted and change nothing
(every prefix is cached). Errors name the Messages field (`messages[1].content[0].type`,
`max_tokens`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.protocol import ChatCompletionRequest, _Body

ROLES = ("user", "assistant")
_FIELDS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config",
           "reasoning_effort": "output_config", "thinking_budget": "thinking.budget_tokens"}


EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Body):
    """The body of `POST /v1/messages`; `count_tokens` takes it without `max_tokens`."""

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=0)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    mcp_servers: list[Any] | None = None  # refused when given: nothing here connects to them
    container: Any = None  # refused when given: no code-execution container runs here


class CountTokensRequest(MessagesRequest):
    """The body of `POST /v1/messages/count_tokens`."""

    max_tokens: int = Field(0, ge=0)


def to_chat(req: MessagesRequest, *, budgets: bool) -> ChatCompletionRequest:
    """The chat request `req` means; `budgets`: whether the server enforces thinking
    budgets. Raises ApiError naming the Messages field."""
    if req.mcp_servers:
        raise ApiError(400, "mcp_servers: MCP connectors do not run here; give their tools as client tools",
                       "mcp_servers")
    if req.container is not None:
        raise ApiError(400, "container: no code-execution container runs here", "container")
    messages = [{"role": "system", "content": _text(req.system, "system", "system")}] if req.system else []
    for i, message in enumerate(req.messages):
        messages += _turn(message, f"messages[{i}]")
    choice = req.tool_choice
    body: dict[str, Any] = {
        "model": req.model,  # it may name a LoRA adapter (`chat_call.adapter_of`)
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences or None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": None if not req.tools else [_tool(t, i) for i, t in enumerate(req.tools)],
        "tool_choice": None if choice is None else _tool_choice(choice),
        "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
    }
    if req.thinking is not None and req.thinking.type in ("enabled", "disabled"):
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
        if req.thinking.type == "enabled" and budgets:
            body["thinking_budget"] = req.thinking.budget_tokens
    config = req.output_config
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = EFFORTS[config.effort]
    if messages and messages[-1]["role"] == "assistant":  # prefill: the answer continues this turn
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    return parse(ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


def renamed(e: ApiError) -> ApiError:
    """An error of the chat request behind a message, naming the Messages field."""
    for chat, ours in _FIELDS.items():
        if e.param == chat or e.message.startswith(chat):
            message = ours + e.message[len(chat):] if e.message.startswith(chat) else e.message
            return ApiError(e.status, message, ours)
    return e


def _turn(message: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Messages turn: a user turn's tool results come first, as
    tool messages, then its text and images; an assistant turn is one message."""
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)} (the system prompt is the top-level "
                            f"system field); got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(400, f"{where}.content must be a string or a list of content blocks", "messages")
    return _user(content, where) if role == "user" else [_assistant(content, where)]


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    results, parts = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at),
                            "content": _result_text(block.get("content"), f"{at}.content")})
        elif kind == "text":
            parts.append({"type": "text", "text": _string(block, "text", at)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{at}.source")}})
        else:
            raise ApiError(400, f"{at}.type {kind!r} is not supported in a user turn: text, image and tool_result "
                                "blocks are", "messages")
    if not parts:
        return results
    plain = all(p["type"] == "text" for p in parts)
    return [*results, {"role": "user", "content": "".join(p["text"] for p in parts) if plain else parts}]


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", at))
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing here can read it
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise ApiError(400, f"{at}.input must be an object", "messages")
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at), "arguments": json.dumps(arguments)}})
        else:
            raise ApiError(400, f"{at}.type {kind!r} is not supported in an assistant turn: text, thinking and "
                                "tool_use blocks are", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _result_text(content: Any, where: str) -> str:
    """A tool result's content as text: a string, or its text blocks joined (an image in
    a result has no place in a chat template's tool message)."""
    if content is None:
        return ""
    return _text(content, where, "messages")


def _text(content: Any, where: str, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text blocks", field)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ApiError(400, f"{where}[{j}] must be a text block (type text, with text); got type {kind!r}",
                           field)
        texts.append(block["text"])
    return "".join(texts)


def _image_url(source: Any, where: str) -> str:
    """An image block's source as the URL a chat image part takes (base64 as a data URL)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise ApiError(400, f"{where} must be {{type: base64, media_type, data}} or {{type: url, url}}", "messages")


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", "messages")
    return value


def _tool(tool: Any, i: int) -> dict[str, Any]:
    """A Messages client tool (`{name, description, input_schema}`) in the chat form."""
    if not isinstance(tool, dict):
        raise ApiError(400, f"tools[{i}] must be an object", "tools")
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise ApiError(400, f"tools[{i}].type {kind!r} is not supported: Anthropic's server tools do not run here; "
                            "give client tools ({name, description, input_schema})", "tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ApiError(400, f"tools[{i}].name must be a non-empty string", "tools")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise ApiError(400, f"tools[{i}].input_schema must be a JSON schema object", "tools")
    fn = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if not choice.name:
            raise ApiError(400, "tool_choice.name is required when tool_choice.type is tool", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
