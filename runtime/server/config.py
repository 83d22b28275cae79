"""HTTP server settings (the model runner's and the scheduler's are in `EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("auto", "none", "hermes", "llama3", "mistral")  # see server.tool_calls


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the HTTP server listens.

    - `port`: 0 picks a free port (the log line "ready at http://..." names it).
    - `api_key`: when set, every route but /health and /metrics needs
      `Authorization: Bearer <api_key>`.
    - `max_request_bytes`: a larger body gets 413 without being read.
    - `served_model_name`: the model id in /v1/models and OpenAI responses (default: the
      model path).
    - `tool_call_parser`: how chat answers are searched for tool calls: a format of
      `sprig.runtime.server.tool_calls`, "auto" (the one the chat template writes, if
      any) or "none" (answers are always plain content).
    - `stats_interval`: seconds between the scheduler's stats reports while busy (they feed
      /metrics); `log_interval`: seconds between activity log lines.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    tool_call_parser: str = "auto"
    max_request_bytes: int = 32 * 1024 * 1024
    stats_interval: float = 0.5
    log_interval: float = 5.0
    log_level: str = "info"
    access_log: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.stats_interval <= 0 or self.log_interval <= 0:
            raise ValueError("stats_interval and log_interval must be > 0")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
