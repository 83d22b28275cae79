"""sprig: a structured-generation runtime for large language models.

The frontend language follows SGLang's, so an SGLang program runs with
`import sprig as sgl`: `@function` programs append text, `gen`, `select`, `image` and
role expressions to a state `s`, fork it, and run on a backend (`RuntimeEndpoint`,
`Runtime`, `OpenAI`, `Anthropic`). `sprig.Engine` is the offline engine (`sprig.runtime.Engine`, as
`sglang.Engine`), imported on first use: importing `sprig` does not import `sprig.runtime`.
"""

from typing import Any

from sprig.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from sprig.backend import Anthropic, Backend, OpenAI, Runtime, RuntimeEndpoint, set_default_backend
from sprig.chat_template import ChatTemplate, get_chat_template, register_chat_template
from sprig.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from sprig.cost import Cost
from sprig.program import Program, function
from sprig.sampling import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from sprig.state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

_NOT_HERE = {
    "video": "sprig programs take images (sgl.image) but not video",
}


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sprig.runtime.engine import Engine

        return Engine
    if name in _NOT_HERE:
        raise AttributeError(f"sprig has no {name}: {_NOT_HERE[name]}")
    raise AttributeError(f"module 'sprig' has no attribute {name!r}")


__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Anthropic",
    "Backend",
    "ChatTemplate",
    "Cost",
    "Engine",
    "OpenAI",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_chat_template",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "register_chat_template",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
