"""Bodies of /tokenize and /detokenize, in the shapes SGLang and vLLM accept (strict like
every body: a wrong JSON type is a 400 naming the field)."""

from __future__ import annotations

from typing import Any

from sprig.runtime.server.protocol import ChatMessage, _Body


class TokenizeRequest(_Body):
    """Exactly one of `prompt` (a text, or SGLang's list of texts) and `messages` (vLLM:
    rendered by the server's chat template first). `add_special_tokens` defaults to true
    for a prompt and false for messages, whose template places the special tokens."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused: a client never supplies a template
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """`tokens`: one sequence of ids, or SGLang's list of sequences."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
