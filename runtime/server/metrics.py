"""Prometheus metrics of one server (its own registry, so two apps in a process do not
collide). Latencies are measured in the HTTP process as outputs arrive; scheduler state
comes from its periodic `StatsReport`."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sprig.runtime.wire import StatsReport

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RETRACTION_BUCKETS = (0, 1, 2, 3, 5, 10, 20)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_received = Counter("sprig_requests_received", "Sequences submitted to the scheduler.", registry=r)
        self.requests_finished = Counter(
            "sprig_requests_finished", "Sequences finished, by outcome (stop, length, abort, error).",
            ["outcome"], registry=r,
        )
        self.running = Gauge("sprig_running_requests", "Requests decoding now.", registry=r)
        self.queued = Gauge("sprig_queued_requests", "Requests waiting to be admitted.", registry=r)
        self.kv_usage = Gauge("sprig_kv_usage", "Share of KV slots held by requests or locked prefixes.", registry=r)
        self.kv_used = Gauge("sprig_kv_used_tokens", "KV slots held by requests or locked prefixes.", registry=r)
        self.hit_rate = Gauge("sprig_cache_hit_rate", "Share of looked-up prompt tokens found in the radix cache.", registry=r)
        self.gen_throughput = Gauge("sprig_gen_throughput", "Generated tokens per second (recent).", registry=r)
        self.prefill_throughput = Gauge("sprig_prefill_throughput", "Prompt tokens computed per second (recent).", registry=r)
        self.spec_accept_rate = Gauge(
            "sprig_spec_accept_rate", "Speculative decoding: share of drafted tokens accepted.", registry=r
        )
        self.spec_accept_length = Gauge(
            "sprig_spec_accept_length", "Speculative decoding: tokens per request per verification pass.", registry=r
        )
        self.prompt_tokens = Counter("sprig_prompt_tokens", "Prompt tokens computed.", registry=r)
        self.cached_tokens = Counter("sprig_cached_tokens", "Prompt tokens reused from the cache.", registry=r)
        self.generation_tokens = Counter("sprig_generation_tokens", "Tokens generated.", registry=r)
        self.retractions = Counter(
            "sprig_retractions", "Requests retracted to free KV slots (their work is redone).", registry=r
        )
        self.preemptions = Counter(
            "sprig_preemptions", "Running requests retracted for a waiting one of higher priority "
            "(--enable-priority-scheduling; counted among the retractions too).", registry=r
        )
        self.request_retractions = Histogram(
            "sprig_num_retractions", "Retractions per finished request.", buckets=RETRACTION_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "sprig_time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram("sprig_inter_token_latency_seconds", "Time between tokens.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "sprig_e2e_request_latency_seconds", "Request latency.", buckets=LATENCY_BUCKETS, registry=r
        )
        self._last: StatsReport | None = None

    def observe_tokens(self, created: float, last_token: float | None, now: float, n_new: int) -> None:
        """`n_new` tokens of one sequence arrived at `now`."""
        if n_new <= 0:
            return
        if last_token is None:
            self.ttft.observe(now - created)
            n_new -= 1
            last_token = now
        for _ in range(n_new):
            self.itl.observe((now - last_token) / n_new)

    def observe_finished(self, finish_reason: dict[str, Any], latency: float, retractions: int) -> None:
        self.requests_finished.labels(finish_reason.get("type", "unknown")).inc()
        self.e2e.observe(latency)
        self.request_retractions.observe(retractions)

    def observe_stats(self, s: StatsReport) -> None:
        self.running.set(s.running)
        self.queued.set(s.queued)
        self.kv_used.set(s.kv_used)
        self.kv_usage.set(s.kv_used / s.kv_size if s.kv_size else 0.0)
        self.hit_rate.set(s.cache_hit_rate)
        self.gen_throughput.set(s.gen_throughput)
        self.prefill_throughput.set(s.prefill_throughput)
        self.spec_accept_rate.set(s.spec_accept_rate)
        self.spec_accept_length.set(s.spec_accept_length)
        last = self._last
        for counter, now, before in (
            (self.prompt_tokens, s.prefill_tokens, last.prefill_tokens if last else 0),
            (self.cached_tokens, s.cached_tokens, last.cached_tokens if last else 0),
            (self.generation_tokens, s.decode_tokens, last.decode_tokens if last else 0),
            (self.retractions, s.retractions, last.retractions if last else 0),
            (self.preemptions, s.preemptions, last.preemptions if last else 0),
        ):
            counter.inc(max(now - before, 0))
        self._last = s

    def render(self) -> bytes:
        return generate_latest(self.registry)
