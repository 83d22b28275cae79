"""A request's thinking budget, from the fields other servers take it in to the
sampling parameters the scheduler enforces (`SamplingParams.thinking_budget`, with the
reasoning markers of the server's `--reasoning-parser`).

Where it is read: `thinking_budget` (SGLang's name) or `thinking_token_budget` (vLLM's) on
`/v1/chat/completions`, `/v1/completions` and `/v1/responses`; `sampling_params.thinking_budget`
on `/generate`; `thinking.budget_tokens` on `/v1/messages`. A server started with
`--thinking-budget` gives chat, Responses and Messages requests that name none its own. Once the reasoning has taken
that many tokens, the output writes the end marker (`</think>`; Magistral's special
`[/THINK]` token) and goes on with the answer, so a reasoning model cannot spend all of
`max_tokens` thinking.

A budget needs the markers of a reasoning format: on a server without one (or with
gpt-oss's harmony, whose analysis may hold tool calls a closing marker would cut) it is a
400 naming the field. A prompt that already closed the reasoning (Qwen3 with
`enable_thinking: false`) has nothing to limit, and its budget changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sprig.runtime.server.config import HARMONY
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.http_io import ServerState
from sprig.runtime.server.reasoning import REASONING_FORMATS, Phase, ReasoningFormat

NAMES = ("thinking_budget", "thinking_token_budget")


def requested(req: Any, default: int | None = None) -> tuple[int | None, str]:
    """The budget an OpenAI request gives (else `default`, the server's) and the field it
    came in (`NAMES`); both fields with different values are a 400."""
    ours, theirs = req.thinking_budget, req.thinking_token_budget
    if ours is not None and theirs is not None and ours != theirs:
        raise ApiError(400, f"thinking_budget ({ours}) and thinking_token_budget ({theirs}) differ; give one",
                       "thinking_token_budget")
    if ours is None and theirs is None:
        return default, NAMES[0]
    return (ours, NAMES[0]) if ours is not None else (theirs, NAMES[1])


def enforced(st: ServerState) -> bool:
    """Whether the server can hold a reasoning to a budget (`reasoning_format` finds its
    markers)."""
    return st.harmony is None and st.config.reasoning_parser in REASONING_FORMATS


def reasoning_format(st: ServerState, field: str) -> ReasoningFormat:
    """The markers a budget given in `field` is enforced with: the server's reasoning
    format; a 400 naming `field` for a server without one, or with harmony."""
    parser = HARMONY if st.harmony is not None else st.config.reasoning_parser
    fmt = REASONING_FORMATS.get(parser or "")
    if fmt is not None:
        return fmt
    if parser is not None:
        raise ApiError(400, f"{field}: a thinking budget is not enforced with the {parser} reasoning format "
                            "(its reasoning may hold tool calls that closing it would cut); "
                            "use reasoning_effort", field)
    raise ApiError(400, f"{field}: a thinking budget needs a reasoning model's markers; start the server with "
                        f"--reasoning-parser ({', '.join(REASONING_FORMATS)})", field)


def budget_params(fmt: ReasoningFormat, phase: Phase, budget: int) -> dict[str, Any]:
    """The sampling parameters that hold an output starting in `phase` to `budget`
    reasoning tokens (none when the prompt closed the reasoning)."""
    if phase is Phase.ANSWER:
        return {}
    return fmt.sampling(phase) | {"thinking_budget": budget}


def with_markers(st: ServerState, sampling: Any, prompts: list[list[int]], prompt_text: Callable[[int], str]) -> Any:
    """`/generate`'s `sampling_params` (one object, a list with one per prompt, or None)
    with the reasoning markers of the server's format added where a prompt's params give
    `thinking_budget` without `reasoning_end`; `prompt_text(i)` is prompt i's text, read
    only for those. Anything malformed is left for the params' own checks."""
    if sampling is None:
        return sampling
    per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if len(per_prompt) != len(prompts):
        return sampling
    out, changed = [], False
    for i, params in enumerate(per_prompt):
        if not isinstance(params, dict) or params.get("thinking_budget") is None or params.get("reasoning_end"):
            out.append(params)
            continue
        fmt = reasoning_format(st, "sampling_params.thinking_budget")
        extra = budget_params(fmt, fmt.phase(prompt_text(i)), params["thinking_budget"])
        out.append(params | extra if extra else {k: v for k, v in params.items() if k != "thinking_budget"})
        changed = True
    return out if changed else sampling
