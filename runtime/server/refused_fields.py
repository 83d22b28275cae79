"""Request fields that other servers honour and sprig does not, each of which would
change the output: a 400 naming the field unless it holds a value that changes nothing.

Unknown top-level fields are otherwise ignored, as clients send many that change
nothing here (`user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
`prediction`, ...); every field that changes the output is either honoured (see
`protocol`) or listed here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sprig.runtime.server.errors import ApiError

# field -> (does this value change nothing?, what to use instead)
Rule = tuple[Callable[[Any, Mapping[str, Any]], bool], str]


def _unset(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None


def _off(value: Any, body: Mapping[str, Any]) -> bool:
    return value is None or value is False or value == []


def _one_of(*values: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    return lambda value, body: value is None or value in values


_COMMON: dict[str, Rule] = {
    "best_of": (lambda v, body: v is None or v in (1, body.get("n", 1)), "use n"),
    "use_beam_search": (_off, "sprig samples or decodes greedily, without beam search"),
    "length_penalty": (_one_of(1, 1.0), "it belongs to beam search"),
    "prompt_logprobs": (_unset, "use /v1/completions with echo and logprobs, or /generate with logprob_start_len"),
    "truncate_prompt_tokens": (_unset, "prompts are never truncated; a prompt too long is a 400"),
    "bad_words": (_off, "use logit_bias"),
    "allowed_token_ids": (_unset, "use logit_bias or a regex"),
    "logits_processors": (_unset, "the server runs no client code"),
    "return_tokens_as_token_ids": (_off, "logprobs carry token text"),
    "return_hidden_states": (_off, "no hidden states are returned"),
}
CHAT: dict[str, Rule] = {
    **_COMMON,
    "functions": (_unset, "use tools"),
    "function_call": (_unset, "use tool_choice"),
    "audio": (_unset, "only text is generated"),
    "modalities": (_one_of(["text"]), "only text is generated"),
    "web_search_options": (_unset, "the server does not search the web"),
    "chat_template": (_unset, "the server never runs a client's template (start it with --chat-template)"),
    "documents": (_unset, "put documents in the messages"),
    "echo": (_off, "use /v1/completions to echo a prompt"),
    "add_special_tokens": (_one_of(False), "the chat template places the special tokens"),
    "stream_reasoning": (_one_of(True), "reasoning is always streamed as it is generated"),
}
COMPLETIONS: dict[str, Rule] = {
    **_COMMON,
    "add_special_tokens": (_one_of(True), "send token ids as the prompt to control special tokens"),
}
RESPONSES: dict[str, Rule] = {
    **_COMMON,
    "n": (_one_of(1), "a response has one output; send several requests"),
    "background": (_off, "responses run in the foreground; stream one to watch it as it is written"),
    "conversation": (_unset, "send the conversation as input, or chain responses with previous_response_id"),
    "prompt": (_unset, "the server keeps no prompt templates; send instructions and input"),
}


def check_refused(body: Any, rules: Mapping[str, Rule]) -> None:
    """Raise a 400 `ApiError` for the first field of `body` (a JSON object) that `rules`
    refuse with the value it holds."""
    if not isinstance(body, Mapping):
        return
    for field, (harmless, instead) in rules.items():
        if field in body and not harmless(body[field], body):
            shown = repr(body[field])
            shown = shown if len(shown) <= 80 else shown[:80] + "..."
            raise ApiError(400, f"{field} {shown} is not supported: {instead}", field)
