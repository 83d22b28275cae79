"""Splitting flat keyword arguments (or CLI flags) into each component's frozen config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sprig.runtime.distributed.config import DistConfig
from sprig.runtime.runner_config import RunnerConfig
from sprig.runtime.scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """The model runner's, the scheduler's and tensor parallelism's settings; each
    component gets only its part."""

    runner: RunnerConfig
    scheduler: SchedulerConfig
    dist: DistConfig = field(default_factory=DistConfig)

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> EngineConfig:
        """Route each keyword to the config that owns it; an unknown key is a `TypeError`."""
        parts: dict[type, dict[str, Any]] = {
            RunnerConfig: {"model_path": model_path}, SchedulerConfig: {}, DistConfig: {}
        }
        owners = {f.name: c for c in parts for f in dataclasses.fields(c)}
        for key, value in kwargs.items():
            owner = owners.get(key)
            if owner is None or key == "model_path":
                known = sorted(k for k in owners if k != "model_path")
                raise TypeError(f"unknown engine argument {key!r}; known arguments: {', '.join(known)}")
            parts[owner][key] = value
        return cls(runner=RunnerConfig(**parts[RunnerConfig]), scheduler=SchedulerConfig(**parts[SchedulerConfig]),
                   dist=DistConfig(**parts[DistConfig]))
