"""The scheduler process's periodic stats: reports for /metrics and the activity log line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sprig.runtime.scheduler.scheduler import Scheduler
from sprig.runtime.wire import StatsReport

log = logging.getLogger("sprig.scheduler")


class _Window:
    """Tokens per busy second since the window was last reset."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.decode = 0
        self.prefill = 0

    def rates(self, decode: int, prefill: int) -> tuple[float, float]:
        if self.busy <= 0:
            return 0.0, 0.0
        return (decode - self.decode) / self.busy, (prefill - self.prefill) / self.busy

    def reset(self, decode: int, prefill: int) -> None:
        self.busy, self.decode, self.prefill = 0.0, decode, prefill


class StatsTracker:
    """Called once per loop iteration; `tick` returns a report every `interval` seconds
    while busy and once on becoming idle, and logs a line every `log_interval` seconds when
    tokens were processed. Throughputs count only time spent busy."""

    def __init__(self, interval: float, log_interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.log_interval = log_interval
        self.integrity = "unchecked"
        self._clock = clock
        self._prev = self._last_report = self._last_log = clock()
        self._was_busy = False
        self._idle_reported = False
        self._report_window, self._log_window = _Window(), _Window()

    def tick(self, scheduler: Scheduler, *, busy: bool) -> StatsReport | None:
        now = self._clock()
        if busy or self._was_busy:
            for w in (self._report_window, self._log_window):
                w.busy += now - self._prev
        self._prev, self._was_busy = now, busy
        if busy:
            self._idle_reported = False
        st = scheduler.stats
        if now - self._last_log >= self.log_interval and st.decode_tokens + st.prefill_tokens > (
            self._log_window.decode + self._log_window.prefill
        ):
            self._log(scheduler, *self._log_window.rates(st.decode_tokens, st.prefill_tokens))
            self._log_window.reset(st.decode_tokens, st.prefill_tokens)
            self._last_log = now
        due = now - self._last_report >= self.interval if busy else not self._idle_reported
        if not due:
            return None
        self._idle_reported = not busy
        self._last_report = now
        gen, prefill = self._report_window.rates(st.decode_tokens, st.prefill_tokens)
        self._report_window.reset(st.decode_tokens, st.prefill_tokens)
        kv = scheduler.kv
        spec = scheduler.speculative.stats if scheduler.speculative is not None else None
        return StatsReport(
            running=len(scheduler.running),
            queued=len(scheduler.waiting),
            kv_used=kv.allocator.size - kv.allocator.available() - kv.cache.evictable_size(),
            kv_size=kv.allocator.size,
            cache_hit_rate=kv.cache.hit_rate,
            prefill_tokens=st.prefill_tokens,
            cached_tokens=st.cached_tokens,
            decode_tokens=st.decode_tokens,
            retractions=st.retractions,
            extend_steps=st.extend_steps,
            decode_steps=st.decode_steps,
            gen_throughput=gen,
            prefill_throughput=prefill,
            integrity=self.integrity,
            spec_accept_rate=spec.acceptance_rate if spec else 0.0,
            spec_accept_length=spec.mean_accept_length if spec else 0.0,
            preemptions=st.preemptions,
        )

    @staticmethod
    def _log(scheduler: Scheduler, gen: float, prefill: float) -> None:
        kv = scheduler.kv
        used = kv.allocator.size - kv.allocator.available() - kv.cache.evictable_size()
        log.info(
            "running %d, queued %d, KV %.1f%% (%d/%d tokens), cache hit %.1f%%, gen %.1f tok/s, prefill %.1f tok/s",
            len(scheduler.running), len(scheduler.waiting), 100 * used / kv.allocator.size, used,
            kv.allocator.size, 100 * kv.cache.hit_rate, gen, prefill,
        )
        if scheduler.speculative is not None:
            spec = scheduler.speculative.stats
            log.info("speculative: %.1f%% of drafts accepted, %.2f tokens per verification",
                     100 * spec.acceptance_rate, spec.mean_accept_length)
