"""Request bodies, as pydantic models in strict mode: a wrong JSON type is a 400 naming
the field (no "5" for 5, no "yes" for true). Unknown top-level fields are ignored (clients
send many), except those of other servers that would change the output, which
`refused_fields` answers with a 400; unknown sampling parameters are not ignored either
(`SamplingParams.from_dict` rejects them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sprig.runtime.weight_update import DEFAULT_GROUP, MAX_BROADCAST_TENSORS

MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class GenerateRequest(_Body):
    """SGLang's native `/generate`: exactly one of `text` and `input_ids`. The logprob
    options take one value for every prompt or a list with one per prompt (their bounds are
    checked with the request, `LogprobOptions`)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: int | list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None  # under --enable-priority-scheduling
    lora_path: str | list[str | None] | None = None  # a loaded LoRA adapter's name (one per prompt in a list)
    # SGLang's: one image (or a list) for a single prompt, a list with one entry per prompt for a batch;
    # each a data URL, base64, an http(s) URL, or a local path under --allowed-local-media-path
    image_data: str | list[str | list[str] | None] | None = None


class AbortRequest(_Body):
    rid: str


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (`constraints` maps it); unknown keys are a 400."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False


class _OpenAISampling(_Body):
    """Sampling fields both OpenAI endpoints share, plus SGLang's extensions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # the constraint is the same whichever backend
    structured_outputs: StructuredOutputs | None = None
    priority: int | None = None  # SGLang's and vLLM's, under --enable-priority-scheduling
    lora_path: str | None = None  # SGLang's: a loaded LoRA adapter's name (or `model` "BASE:ADAPTER")
    thinking_budget: int | None = Field(None, ge=0)  # SGLang's name; vLLM's is thinking_token_budget
    thinking_token_budget: int | None = Field(None, ge=0)  # (server.thinking_budget)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str  # a data URL, base64, an http(s) URL, or a local path under --allowed-local-media-path
    detail: Literal["auto", "low", "high"] | None = None  # taken and ignored: one resolution per model


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (SGLang's name; vLLM's `reasoning`)
    reasoning: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    separate_reasoning: bool = True


class ScoringRequest(_Body):
    """SGLang's `/v1/score` (`sprig.runtime.label_scores`): `query` and `items` both text or
    both token ids; the other checks are `score_call`'s."""

    model: str | None = None
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False


class EncodeRequest(_Body):
    """SGLang's native `/encode`: exactly one of `text` and `input_ids`."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # a loaded LoRA adapter's name (one per prompt in a list)


class EmbeddingRequest(_Body):
    """OpenAI's `/v1/embeddings`. `dimensions` keeps the first components of each
    embedding, normalized again (Matryoshka-trained models, e.g. Qwen3-Embedding, are
    made for it)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang's `/update_weights_from_disk` (`routes_weights`). `flush_cache` may only be
    true: cached prefixes hold K/V the old weights computed."""

    model_path: str = Field(min_length=1, max_length=4096)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    flush_cache: bool = True


class PauseGenerationRequest(_Body):
    """SGLang's `/pause_generation` (`routes_weights`): what happens to the requests in
    flight (`Scheduler.pause`)."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionRequest(_Body):
    """SGLang's `/update_weight_version`: a new label for the weights in place."""

    new_version: str = Field(min_length=1, max_length=256)
    abort_all_requests: bool = False


class GetWeightsByNameRequest(_Body):
    """SGLang's `/get_weights_by_name`: the first `truncate_size` rows of a weight, by its
    checkpoint name."""

    name: str = Field(min_length=1, max_length=1024)
    truncate_size: int = Field(100, ge=1)


class InitWeightsUpdateGroupRequest(_Body):
    """SGLang's `/init_weights_update_group` (`routes_weights`; checked by `GroupSpec`)."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = Field(DEFAULT_GROUP, min_length=1, max_length=256)
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Body):
    """SGLang's `/update_weights_from_distributed` (`routes_weights`; checked by
    `BroadcastPlan`): `names`, `dtypes` and `shapes` of the tensors the trainer broadcasts,
    in order, or SGLang's earlier one-tensor form `name`, `dtype`, `shape`. `flush_cache`
    and `torch_empty_cache` are taken and change nothing (the radix cache is always
    dropped; the allocator is left as it is); `load_format` may only be null."""

    names: list[Annotated[str, Field(max_length=1024)]] | None = Field(None, max_length=MAX_BROADCAST_TENSORS)
    dtypes: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=MAX_BROADCAST_TENSORS)
    shapes: list[list[int]] | None = Field(None, max_length=MAX_BROADCAST_TENSORS)
    name: str | None = Field(None, max_length=1024)
    dtype: str | None = Field(None, max_length=64)
    shape: list[int] | None = Field(None, max_length=16)
    group_name: str = Field(DEFAULT_GROUP, min_length=1, max_length=256)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = Field(None, min_length=1, max_length=256)
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupRequest(_Body):
    """SGLang's `/destroy_weights_update_group`."""

    group_name: str = Field(DEFAULT_GROUP, min_length=1, max_length=256)


class LoadLoRAAdapterRequest(_Body):
    """SGLang's `/load_lora_adapter`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """SGLang's `/unload_lora_adapter`."""

    lora_name: str = Field(min_length=1, max_length=256)
