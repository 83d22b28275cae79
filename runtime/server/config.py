"""HTTP server settings (the model runner's and the scheduler's are in `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sprig.runtime.server.reasoning import REASONING_FORMATS

LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3", "mistral", "mistral_v11", "qwen3_coder", "gpt-oss")  # server.tool_formats, server.harmony
REASONING_PARSERS = ("qwen3", "deepseek-r1", "mistral", "gpt-oss")  # server.reasoning, server.harmony
HARMONY = "gpt-oss"  # OpenAI's harmony format, both reasoning and tool calls
# SGLang's and vLLM's names for the same formats, so their launch flags work unchanged
TOOL_CALL_PARSER_ALIASES = {"qwen25": "hermes", "qwen": "hermes", "llama3_json": "llama3", "qwen3_xml": "qwen3_coder",
                            "openai": HARMONY}
REASONING_PARSER_ALIASES = {"deepseek_r1": "deepseek-r1", "openai_gptoss": HARMONY, "gpt_oss": HARMONY}


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the HTTP server listens.

    - `port`: 0 picks a free port (the log line "ready at http://..." names it).
    - `api_keys`: when any is set, every route but /health and /metrics needs
      `Authorization: Bearer <key>` with one of them. Each key is a client of its own:
      `/abort_request` aborts only requests sent with the same key.
    - `max_request_bytes`: a larger body gets 413 without being read.
    - `served_model_name`: the model id in /v1/models and OpenAI responses (default:
      `default_model_name`, the checkpoint directory's name, so responses never carry a
      path of the server's file system).
    - `chat_template`: a Jinja file rendering chat messages, instead of the tokenizer's
      template (clients can pass variables to the template, never a template).
    - `tool_call_parser`: how chat answers are searched for tool calls: a format of
      `sprig.runtime.server.tool_formats`, "gpt-oss" (harmony, `server.harmony`), "auto"
      (the one the chat template writes, if any, harmony included) or "none" (answers
      are always plain content). A forced call (`tool_choice` "required" or named) needs
      no format: without one it is a bare JSON object `{"name": ..., "arguments": {...}}`,
      constrained to the tool's schema.
    - `reasoning_parser`: the thinking format of a reasoning model (`<think>...</think>`;
      "mistral": Magistral's `[THINK]...[/THINK]`, special tokens), split off as
      `reasoning_content`; constraints then apply to the answer after it.
      "gpt-oss": OpenAI's harmony format (`server.harmony`), whose analysis channel is the
      reasoning and whose final channel is the answer; it reads tool calls too, so it goes
      with `tool_call_parser` "auto", "none" or "gpt-oss" (and "gpt-oss" there with no
      other reasoning parser). "auto" picks harmony from a chat template that writes it.
      Both take SGLang's and vLLM's names of the same formats (`TOOL_CALL_PARSER_ALIASES`,
      `REASONING_PARSER_ALIASES`: "qwen25" is "hermes", "openai" is "gpt-oss", ...), and
      hold the name they stand for.
    - `thinking_budget`: the thinking budget (`server.thinking_budget`) of chat, Responses
      and Messages requests that give none; needs a `reasoning_parser` of think markers
      (qwen3, deepseek-r1, mistral). `/v1/completions` and `/generate` send raw prompts and
      take a budget only when they give one.
    - `responses_store_bytes`: how much JSON of stored responses (`/v1/responses` with
      `store`, the default) the server keeps in memory for `previous_response_id` and
      `GET /v1/responses/{id}`, the least recently used dropped first; 0 keeps none.
    - `read_timeout`: seconds a client has to send a request's headers, and again its
      body (slow clients hold connections and memory otherwise).
    - `watchdog_timeout`: seconds a child may go without a heartbeat (its main loop turns
      about once a second, and once per scheduler step) before the server counts it
      stuck, answers 503 and exits non-zero.
    - `stats_interval`: seconds between the scheduler's stats reports while busy (they feed
      /metrics); `log_interval`: seconds between activity log lines.
    - Images (a vision-language model): `allowed_local_media_path`, a directory whose
      files requests may name by path (None: local paths refused); `disable_media_urls`
      refuses http(s) image URLs (else fetched, within a size cap and a time limit).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_keys: tuple[str, ...] = ()
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None
    thinking_budget: int | None = None
    max_request_bytes: int = 32 * 1024 * 1024
    responses_store_bytes: int = 64 * 1024 * 1024
    read_timeout: float = 30.0
    watchdog_timeout: float = 300.0
    stats_interval: float = 0.5
    log_interval: float = 5.0
    log_level: str = "info"
    access_log: bool = False
    allowed_local_media_path: str | None = None
    disable_media_urls: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tool_call_parser",
                           TOOL_CALL_PARSER_ALIASES.get(self.tool_call_parser, self.tool_call_parser))
        if self.reasoning_parser is not None:
            object.__setattr__(self, "reasoning_parser",
                               REASONING_PARSER_ALIASES.get(self.reasoning_parser, self.reasoning_parser))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not all(self.api_keys) or len(set(self.api_keys)) < len(self.api_keys):
            raise ValueError("api_keys must be non-empty and distinct")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.responses_store_bytes < 0:
            raise ValueError(f"responses_store_bytes must be >= 0, got {self.responses_store_bytes}")
        if self.stats_interval <= 0 or self.log_interval <= 0:
            raise ValueError("stats_interval and log_interval must be > 0")
        if self.read_timeout <= 0:
            raise ValueError(f"read_timeout must be > 0, got {self.read_timeout}")
        if self.watchdog_timeout < 2:
            raise ValueError(f"watchdog_timeout must be >= 2 s (children send a heartbeat each second), got {self.watchdog_timeout}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template {self.chat_template!r} is not a file")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        other_tools = self.tool_call_parser not in ("auto", "none", HARMONY)
        if (self.reasoning_parser == HARMONY and other_tools) or (
                self.tool_call_parser == HARMONY and self.reasoning_parser not in (None, HARMONY)):
            raise ValueError(f"the {HARMONY} format holds both reasoning and tool calls: reasoning_parser "
                             f"{self.reasoning_parser!r} cannot go with tool_call_parser {self.tool_call_parser!r}")
        if self.thinking_budget is not None and (self.thinking_budget < 0
                                                 or self.reasoning_parser not in REASONING_FORMATS):
            raise ValueError(f"thinking_budget must be >= 0 and needs a reasoning_parser of think markers "
                             f"({', '.join(REASONING_FORMATS)}); got {self.thinking_budget} with reasoning_parser "
                             f"{self.reasoning_parser!r}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")


def default_model_name(model_path: str) -> str:
    """The served model id when none is given: "sprig-demo" for the embedded demo model,
    else the checkpoint directory's name."""
    from sprig.runtime.demo import DEMO_MODEL_PATH

    path = Path(model_path).resolve()
    return "sprig-demo" if path == DEMO_MODEL_PATH.resolve() else path.name
