"""One chat request as the scheduler's requests: its tools planned, its messages rendered
and tokenized, its constraint and sampling parameters checked, and the format its answer
is read back in. `/v1/chat/completions` and `/v1/responses` both build calls here;
`/v1/completions` shares the sampling and error helpers."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from sprig.runtime.multimodal.inputs import ImageInput
from sprig.runtime.request_contract import LogprobOptions, TokenizedRequest
from sprig.runtime.scheduler.grammar import GRAMMAR_ERROR
from sprig.runtime.server import thinking_budget
from sprig.runtime.server.answer_decoding import answer_decoding
from sprig.runtime.server.chat_answer import AnswerFormat
from sprig.runtime.server.constraints import Constraint, request_constraint
from sprig.runtime.server.errors import ApiError
from sprig.runtime.server.http_io import ServerState, client_gone
from sprig.runtime.server.openai_format import sampling_dict
from sprig.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from sprig.runtime.server.reasoning import REASONING_FORMATS, Phase
from sprig.runtime.server.request_manager import Call, RequestFailed
from sprig.runtime.server.tool_calls import plan_tool_use

REASONING_EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class ChatCall:
    """What a chat request sends (`requests`: one per prompt, each with `n` samples) and
    how its answers read (`fmt`); `constraint`: the request's own, named in its errors."""

    fmt: AnswerFormat
    requests: list[TokenizedRequest]
    constraint: Constraint | None


def chat_call(st: ServerState, req: ChatCompletionRequest) -> ChatCall:
    """Plan, render, tokenize and check `req` (run it off the event loop: it tokenizes).
    Raises ApiError (a 4xx naming the field)."""
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    budget, budget_field = thinking_budget.requested(req, st.config.thinking_budget)
    if budget is not None:
        thinking_budget.reasoning_format(st, budget_field)
    constraint = request_constraint(req)
    tools = plan_tool_use(req.tools, req.tool_choice, st.tool_format, constraint,
                          several=req.parallel_tool_calls is not False, context_free=st.context_free)
    text = st.builder.chat_text(req.messages, tools.rendered, _template_variables(st, req), **_continuation(req))
    turn = None
    if st.harmony is not None:
        turn = st.harmony.turn(text, tools, constraint, req.separate_reasoning, st.context_free)
        text, tools = turn.prompt, turn.tools
    sources = st.builder.chat_images(req.messages)
    if sources:
        ids, images = st.builder.with_images(text, sources, param="messages", field="messages",
                                             add_special_tokens=False)
    else:
        ids, images = st.builder.encode(text, add_special_tokens=False, param="messages"), ()
    one_call = req.parallel_tool_calls is False
    if turn is not None:
        fmt = AnswerFormat(None, Phase.ANSWER, None, tools.names, forced=tools.forced, one_call=one_call,
                           harmony=turn.reader)
        extra = turn.sampling
    else:
        reasoning = REASONING_FORMATS.get(st.config.reasoning_parser or "")
        phase = reasoning.phase(text) if reasoning is not None else Phase.ANSWER
        decoding = answer_decoding(reasoning, tools.parse_format, st.builder.tokenizer)
        fmt = AnswerFormat(reasoning if req.separate_reasoning else None, phase, tools.parse_format, tools.names,
                           forced=tools.forced, one_call=one_call,
                           gated=tools.trigger is not None and (reasoning is None or req.separate_reasoning),
                           decoding=decoding)
        extra = (tools.grammar_params(st.context_free) | decoding.params
                 | (reasoning.sampling(phase) if reasoning is not None else {}))
        if budget is not None:
            extra |= thinking_budget.budget_params(reasoning, phase, budget)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    own = constraint if tools.regex is None else None  # else the tools' grammar holds it
    sampling = [sampling_for(st, req, own, len(ids), max_tokens, **extra)]
    logprobs = LogprobOptions(req.logprobs, -1, req.top_logprobs or 0, True)
    adapter = adapter_of(st, req.model, req.lora_path)
    return ChatCall(fmt, contract_requests(st, [ids], sampling, logprobs, req.stream, constraint, req.priority,
                                           adapter, [images]), constraint)


def adapter_of(st: ServerState, model: str | None, lora_path: str | None) -> str | None:
    """The LoRA adapter an OpenAI request runs with: `lora_path` (SGLang's field), else a
    `model` that names a loaded adapter, alone ("ADAPTER", as vLLM's clients name it) or
    after the served model ("MODEL:ADAPTER", as SGLang's); else None (the base model:
    any other `model` is served by it, as before). A "MODEL:ADAPTER" whose adapter is not
    loaded is a 400 naming `model`; an unknown `lora_path` is refused by the scheduler."""
    if lora_path is not None:
        return lora_path
    adapters = st.manager.weights.adapters
    if model is None or not adapters:
        return None
    if model in adapters:
        return model
    base, sep, name = model.rpartition(":")
    if sep and base == st.model_name:
        if name not in adapters:
            loaded = ", ".join(repr(n) for n in adapters)
            raise ApiError(400, f"model {model!r}: no LoRA adapter named {name!r} is loaded (loaded: {loaded})",
                           "model")
        return name
    return None


def sampling_for(st: ServerState, req: CompletionRequest | ChatCompletionRequest, constraint: Constraint | None,
                 prompt_len: int, max_tokens: int | None, **extra: Any) -> dict[str, Any]:
    """The sampling parameters of one prompt, for the request contract to check. `extra`:
    parameters of the server's own (a forced tool call's regex, the reasoning markers)."""
    max_new = st.builder.room(prompt_len) if max_tokens is None else max_tokens
    d = sampling_dict(req, max_new, constraint)
    d.update({k: v for k, v in extra.items() if v is not None})
    return d


def contract_requests(st: ServerState, prompts: list[list[int]], sampling: list[dict[str, Any]],
                      logprobs: LogprobOptions, stream: bool, constraint: Constraint | None,
                      priority: int | None = None, adapter: str | None = None,
                      images: list[tuple[ImageInput, ...]] | None = None) -> list[TokenizedRequest]:
    """The request contract over OpenAI prompts (`images`: each prompt's, or None); an
    invalid constraint is a 400 naming the field it came from."""
    try:
        return st.builder.requests(prompts, sampling, None, logprobs, stream=stream, prompt_field="prompt",
                                   priority=priority, lora_path=adapter, images=images)
    except ApiError as e:
        if constraint is None or constraint.key not in e.message:
            raise
        raise ApiError(400, f"{constraint.field}: {e.message}", constraint.param) from None


async def collect(call: Call, request: Request, constraint: Constraint | None) -> list[dict[str, Any]]:
    """Every response of `call`, once all are done (aborted if the client leaves)."""
    try:
        return await call.collect(functools.partial(client_gone, request))
    except RequestFailed as e:
        raise named(e, constraint) from None


async def reasoning_tokens(st: ServerState, fmt: AnswerFormat, texts: list[str]) -> int | None:
    """How many tokens the reasoning of the outputs `texts` took, tokenized on the request
    pool (the reasoning as `reasoning_content` holds it, without its markers and the blanks
    around them); None when the answers' reasoning is not split off."""
    if not fmt.splits_reasoning:
        return None
    reasonings = [r for r in (fmt.parts(t, True)[0] for t in texts) if r]
    if not reasonings:
        return 0
    tokenizer = st.builder.tokenizer

    def count() -> int:
        return sum(len(tokenizer.encode(r, add_special_tokens=False)) for r in reasonings)

    return await asyncio.get_running_loop().run_in_executor(st.pool, count)


def named(e: RequestFailed, constraint: Constraint | None) -> RequestFailed | ApiError:
    """A constraint the scheduler could not compile, as a 400 naming the field it came from."""
    if constraint is None or e.status != 400 or not e.message.startswith(GRAMMAR_ERROR):
        return e
    return ApiError(400, f"{constraint.field}: {e.message}", constraint.param)


def _continuation(req: ChatCompletionRequest) -> dict[str, bool]:
    """How the conversation ends: a generation prompt (the default), or, with
    `continue_final_message`, the last message left open (vLLM's and SGLang's meaning)."""
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       "continue_final_message")
    cont = req.continue_final_message
    return {"add_generation_prompt": req.add_generation_prompt and not cont, "continue_final": cont}


def _template_variables(st: ServerState, req: ChatCompletionRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs`, plus `reasoning_effort` (one of `REASONING_EFFORTS`, as
    gpt-oss's template takes it) for a template that reads it (a 400 for one that does
    not: the field would change nothing)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    if req.reasoning_effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; "
                            f"got {req.reasoning_effort!r}", "reasoning_effort")
    if st.builder.chat is None or "reasoning_effort" not in st.builder.chat.free_variables:
        raise ApiError(400, "reasoning_effort: this model's chat template takes no reasoning effort",
                       "reasoning_effort")
    return {**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}
