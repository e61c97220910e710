"""Prometheus metrics of one server, in a registry of its own (so that several apps in one
process, as in the tests, never share counters).

Names follow vLLM's (`vllm:` -> `blockdraft:`). Per-request figures are recorded by the handlers
as requests end; engine state (queue lengths, KV-cache usage, speculative-decoding counters) is
read when Prometheus scrapes, so it can never drift from the engine's own numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from blockdraft.outputs import RequestOutput
from blockdraft.server.async_engine import AsyncEngine

PREFIX = "blockdraft:"
FINISH_REASONS = ("stop", "length", "abort", "error")
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield _gauge("num_requests_running", "Requests in the running batch", engine.num_running)
        yield _gauge(
            "num_requests_waiting", "Requests waiting for a slot or KV blocks", engine.num_waiting
        )
        yield _gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full)",
            engine.engine.block_manager.usage,
        )
        stats = engine.engine.spec_stats
        yield _counter("spec_decode_num_drafts", "Speculative verify steps", stats.num_drafts)
        yield _counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed", stats.num_draft_tokens
        )
        yield _counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens
        )
        yield _gauge(
            "spec_decode_mean_acceptance_length",
            "Mean tokens committed per verify step (accepted drafts + 1); 0 before any",
            stats.mean_acceptance_length,
        )
        yield _num_drafts_histogram(stats.steps_by_num_drafts, stats.num_speculative_tokens)


def _num_drafts_histogram(steps_by_n: dict[int, int], max_n: int) -> HistogramMetricFamily:
    """Engine steps by the N chosen for their drafts, one bucket per N in 0..max_n."""
    buckets, total = [], 0
    for n in range(max_n + 1):
        total += steps_by_n.get(n, 0)
        buckets.append((str(float(n)), total))  # le="2.0", as Prometheus writes it
    buckets.append(("+Inf", sum(steps_by_n.values())))
    return HistogramMetricFamily(
        PREFIX + "spec_decode_num_drafts_per_step",
        "Draft tokens per request chosen for each speculative engine step (0: none)",
        buckets=buckets,
        sum_value=sum(n * c for n, c in steps_by_n.items()),
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests that ended, by finish reason",
            ["finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)  # export zeros before the first request
        self.rejected = Counter(
            PREFIX + "rejected_requests",
            "Requests refused before generation, by HTTP status",
            ["status"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of requests that ended", registry=reg
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated for requests that ended", registry=reg
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Per request: time after the first token divided by the tokens after it",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last output token",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        reg.register(_EngineCollector(engine))

    def record_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def record_finished(
        self,
        last: RequestOutput | None,
        finish_reason: str,
        arrival: float,
        first_token: float | None,
        end: float,
    ) -> None:
        """One request that reached the engine has ended (`last`: its newest output)."""
        self.requests.labels(finish_reason).inc()
        if last is None:
            return
        num_generated = len(last.outputs[0].token_ids)
        self.prompt_tokens.inc(len(last.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        if first_token is None:
            return
        self.time_to_first_token.observe(first_token - arrival)
        self.e2e_latency.observe(end - arrival)
        if num_generated > 1:
            self.time_per_output_token.observe((end - first_token) / (num_generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
