"""Continuous batching with radix prefix reuse, chunked prefill and retraction."""

from sprig.runtime.scheduler.config import SCHEDULE_POLICIES, SchedulerConfig
from sprig.runtime.scheduler.intake import QueueFull, RequestRejected
from sprig.runtime.scheduler.request import FinishReason, Req
from sprig.runtime.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = [
    "SCHEDULE_POLICIES",
    "FinishReason",
    "QueueFull",
    "Req",
    "RequestRejected",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
]
