"""Backends: where a program's model calls go.

`Backend` is the interface (`sprig.backend.base`); `RuntimeEndpoint` speaks SGLang's
native API to a sprig or SGLang server, `Runtime` launches a sprig server and wraps a
`RuntimeEndpoint` to it, `OpenAI` speaks to any OpenAI-compatible server and `Anthropic`
to Anthropic's Messages API (Anthropic's service, or a sprig server's `/v1/messages`).
"""

from sprig.backend.anthropic import Anthropic
from sprig.backend.base import (
    Backend,
    ChoiceLogprobs,
    Generation,
    Prompt,
    Selection,
    StreamChunk,
    resolve_backend,
    set_default_backend,
)
from sprig.backend.http import ServerError
from sprig.backend.openai import OpenAI
from sprig.backend.runtime import Runtime
from sprig.backend.runtime_endpoint import RuntimeEndpoint

__all__ = [
    "Anthropic",
    "Backend",
    "ChoiceLogprobs",
    "Generation",
    "OpenAI",
    "Prompt",
    "Runtime",
    "RuntimeEndpoint",
    "Selection",
    "ServerError",
    "StreamChunk",
    "resolve_backend",
    "set_default_backend",
]
