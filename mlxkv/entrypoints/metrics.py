"""Prometheus figures of `mlxkv serve`: each loaded model's engine state read from one `stats()`
snapshot per scrape, token counts and latencies as served; every figure has a `model` label."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.llm_engine import LLMEngine
from ..engine.outputs import RequestOutput

Engines = Callable[[], Mapping[str, LLMEngine]]  # the loaded models' engines, by model name


class EngineCollector(Collector):
    """Each loaded engine's gauges and counters, each engine's from one snapshot."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Family] = {}
        for model, engine in self.engines().items():
            for kind, name, doc, labels, value in _figures(engine):
                family = families.get(name)
                if family is None:
                    family = families[name] = kind(name, doc, labels=["model", *labels])
                family.add_metric([model, *labels.values()], value)
        yield from families.values()


Family = GaugeMetricFamily | CounterMetricFamily
Figure = tuple[type[Family], str, str, dict[str, str], float]  # a family's kind, name, help, labels and value


def _figures(engine: LLMEngine) -> Iterator[Figure]:
    """One engine's figures, from one `stats()` snapshot."""
    stats = engine.stats()
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    gauges = {
        "running_requests": ("Requests being computed", stats.running),
        "waiting_requests": ("Requests waiting to be admitted", stats.waiting),
        "kv_pages_used": ("KV pages held by requests", stats.kv.pages_used),
        "kv_pages_total": ("KV pages in the pool", stats.kv.pages_total),
        "kv_pages_pinned": ("KV pages pinned for a while (cache_control), in use", stats.kv.pages_pinned),
        "kv_bytes_holding_tokens": ("KV bytes holding tokens", stats.kv.bytes_holding_tokens),
        "states_used": ("Sequences holding a recurrent state (hybrid models)", stats.kv.states_used),
        "states_total": ("Sequences the recurrent-state pool has room for (hybrid models)", stats.kv.states_total),
        "state_bytes_used": ("Bytes of the recurrent states held (hybrid models)", stats.kv.state_bytes_used),
        "preemptions": ("Requests preempted so far", stats.preemptions),
        "prefix_cache_hit_rate": ("Share of prompt tokens reused from the prefix cache", stats.prefix_cache.hit_rate),
    }
    lookups = stats.prefix_cache
    yield (
        counter,
        "mlxkv_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        {},
        lookups.prompt_tokens,
    )
    yield counter, "mlxkv_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", {}, lookups.cached_tokens
    disk = stats.kv.disk
    if disk is not None:
        for name, doc, value in (
            ("disk_cache_restored_pages", "KV pages read back from the disk tier", disk.pages_restored),
            ("disk_cache_read_bytes", "Bytes read from the disk tier", disk.bytes_read),
            ("disk_cache_written_bytes", "Bytes written to the disk tier", disk.bytes_written),
            ("disk_cache_restore_seconds", "Seconds spent reading pages back from the disk tier", disk.restore_seconds),
            (
                "disk_cache_dropped_writes",
                "Runs of pages not written (queue full, disk nearly full)",
                disk.writes_dropped,
            ),
        ):
            yield counter, f"mlxkv_{name}", doc, {}, value
    speculation = stats.speculation
    if speculation is not None:
        gauges["spec_acceptance_rate"] = ("Share of draft tokens the model accepted", speculation.acceptance_rate)
        yield counter, "mlxkv_spec_draft_tokens", "Draft tokens proposed", {}, speculation.drafted
        yield counter, "mlxkv_spec_accepted_tokens", "Draft tokens accepted", {}, speculation.accepted
    for name, (doc, value) in gauges.items():
        yield gauge, f"mlxkv_{name}", doc, {}, value
    if stats.memory is not None:
        yield gauge, "mlxkv_memory_limit_bytes", "The memory budget", {}, stats.memory.limit
        for part, size in stats.memory.parts().items():
            yield gauge, "mlxkv_memory_budget_bytes", "The memory budget's parts", {"part": part}, size
    yield gauge, "mlxkv_memory_peak_bytes", "Most memory MLX has held at once", {}, stats.peak_memory


class Metrics:
    """Every figure `/metrics` serves, in a registry of its own: those of `engines`, and what
    each model served (`of`)."""

    def __init__(self, engines: Engines) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engines))
        model = ["model"]
        self.prompt_tokens = Counter("mlxkv_prompt_tokens", "Prompt tokens served", model, registry=self.registry)
        self.generation_tokens = Counter("mlxkv_generation_tokens", "Tokens generated", model, registry=self.registry)
        self.reasoning_tokens = Counter(
            "mlxkv_reasoning_tokens", "Tokens generated as a thinking model's reasoning", model, registry=self.registry
        )
        self.ttft = Histogram(
            "mlxkv_time_to_first_token_seconds",
            "Time to first token",
            model,
            registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.itl = Histogram(
            "mlxkv_inter_token_latency_seconds",
            "Time between tokens",
            model,
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )

    def of(self, model: str) -> ModelMetrics:
        """What one model serves is counted under its name."""
        return ModelMetrics(
            self.prompt_tokens.labels(model),
            self.generation_tokens.labels(model),
            self.reasoning_tokens.labels(model),
            self.ttft.labels(model),
            self.itl.labels(model),
        )


@dataclass(frozen=True)
class ModelMetrics:
    """One model's counters and histograms."""

    prompt_tokens: Counter
    generation_tokens: Counter
    reasoning_tokens: Counter
    ttft: Histogram
    itl: Histogram

    def timer(self, choices: int) -> RequestTimer:
        """A timer for one request of `choices` choices, started now."""
        return RequestTimer(self, choices)


class RequestTimer:
    """Observes one request's outputs: time to first token and between tokens, per choice, and token counts."""

    def __init__(self, metrics: ModelMetrics, choices: int) -> None:
        self.metrics = metrics
        self.last = [time.perf_counter()] * choices
        self.first = [True] * choices

    def observe(self, index: int, output: RequestOutput) -> None:
        now, tokens = time.perf_counter(), len(output.token_ids)
        if tokens:
            (self.metrics.ttft if self.first[index] else self.metrics.itl).observe(now - self.last[index])
            self.last[index], self.first[index] = now, False
            self.metrics.generation_tokens.inc(tokens)
        if output.finished and output.usage is not None:
            self.metrics.prompt_tokens.inc(output.usage.prompt_tokens)
            self.metrics.reasoning_tokens.inc(output.usage.reasoning_tokens)
