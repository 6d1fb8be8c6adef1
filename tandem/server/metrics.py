"""Prometheus metrics for the server: `tandem:` + vLLM's metric names, per engine.

`PrometheusStatLogger` is a stat logger (`tandem.engine.stats.StatLogger`): the AsyncLLM
hands it each engine's `engine_stats` dict (see `core/hookspecs.py`) and the front end's
per-batch `IterationStats`. It keeps its metrics on its own `CollectorRegistry`, never the
process-global one, so several engines (and tests) can live in one process. Every metric
carries the labels `model_name` and `engine` (the engine index), as vLLM's do.

How engine numbers become metrics: gauges are set; cumulative counters (the engine's
numbers since it started) increase the Prometheus counter by the difference from the last
value seen for that engine, never by a negative amount (a smaller value is taken as the new
baseline); lists of observations are observed one by one. `render_metrics(engine)` is what
the `/metrics` route returns. docs/metrics.md lists the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tandem.engine.stats import IterationStats

PREFIX = "tandem:"
LABELS = ("model_name", "engine")

# vLLM's buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: Grammar compiles (not a vLLM metric): from a cache hit to a slow schema.
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: `max_model_len` for the token-count buckets when the logger is not told it.
DEFAULT_MAX_MODEL_LEN = 131072

#: engine_stats key -> gauge (name after the prefix, help).
ENGINE_GAUGES = {
    "num_running_reqs": ("num_requests_running", "Number of requests in model execution batches."),
    "num_waiting_reqs": ("num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache_usage": ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "batch_queue_depth": ("batch_queue_depth", "Steps queued in the engine's batch queue."),
    "num_output_placeholders": (
        "num_output_placeholders",
        "Output tokens scheduled but not yet resolved (async scheduling placeholders).",
    ),
}
#: engine_stats key -> counter fed by differences of the cumulative value.
ENGINE_COUNTERS = {
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in terms of cached tokens."),
    "num_preemptions": ("num_preemptions", "Cumulative number of preemptions from the engine."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
    ),
    # a KV connector in the stack (docs/kv-connectors.md)
    "kv_connector_external_hit_tokens": (
        "kv_connector_external_hit_tokens",
        "Prompt tokens the KV connector supplied instead of their computation.",
    ),
    "kv_connector_failed_load_blocks": (
        "kv_connector_failed_load_blocks",
        "KV blocks whose connector load failed (recomputed).",
    ),
    "kv_connector_rolled_back_requests": (
        "kv_connector_rolled_back_requests",
        "Requests rolled back to their last good block after a failed KV load.",
    ),
    # recorded by the front end (AsyncLLM), which restarts a dead engine core
    "engine_core_restarts": (
        "engine_core_restarts",
        "Engine-core processes restarted after they died.",
    ),
}
PER_POS_KEY = "spec_decode_num_accepted_tokens_per_pos"
#: `kv_connector_transfers` (the connector worker's counters, `COUNTER[@TIER]`) -> counter
#: with a `tier` label (`all` for a counter without a tier). Other names stay in
#: engine_stats only.
TRANSFERS_KEY = "kv_connector_transfers"
KV_TRANSFER_COUNTERS = {
    "loaded_tokens": "Tokens the KV connector loaded into the pool.",
    "saved_tokens": "Tokens the KV connector saved from the pool.",
    "load_seconds": "Wall time the worker spent loading KV (the load phase of each step).",
    "save_seconds": "Wall time the worker spent saving KV (the save phase of each step).",
    "failed_loads": "KV block loads the connector reported failed.",
}
#: Finish reasons every engine's request_success counter shows from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """The serving metrics on one registry, per engine index (see the module docstring).

    `data_parallel_size`: engines 0..N-1 get their series (at 0) before their first record;
    any other index gets its series when first recorded. `max_model_len` bounds the buckets of
    the per-request token histograms (vLLM's 1-2-5 series). Not thread-safe against itself:
    one thread calls `record` (the AsyncLLM's output loop); rendering may run anywhere.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int | None = None,
        data_parallel_size: int = 1,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        token_buckets = build_1_2_5_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self._gauges = {
            key: self._metric(Gauge, name, doc) for key, (name, doc) in ENGINE_GAUGES.items()
        }
        self._counters = {
            key: self._metric(Counter, name, doc) for key, (name, doc) in ENGINE_COUNTERS.items()
        }
        self._accepted_per_pos = self._metric(
            Counter, PER_POS_KEY, "Accepted tokens per draft position.", ("position",)
        )
        self._kv_transfers = {
            name: self._metric(Counter, f"kv_connector_{name}", doc, ("tier",))
            for name, doc in KV_TRANSFER_COUNTERS.items()
        }
        self._prompt_tokens = self._metric(Counter, "prompt_tokens", "Prefill tokens processed.")
        self._generation_tokens = self._metric(
            Counter, "generation_tokens", "Generation tokens processed."
        )
        self._request_success = self._metric(
            Counter, "request_success", "Count of finished requests.", ("finished_reason",)
        )
        histogram = self._histogram
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self._e2e = histogram(
            "e2e_request_latency_seconds", "End to end request latency.", REQUEST_LATENCY_BUCKETS
        )
        self._queue_time = histogram(
            "request_queue_time_seconds", "Time spent in WAITING.", REQUEST_LATENCY_BUCKETS
        )
        self._request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self._request_generation_tokens = histogram(
            "request_generation_tokens", "Generation tokens per finished request.", token_buckets
        )
        self._request_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", token_buckets
        )
        self._request_n = histogram(
            "request_params_n", "The n request parameter.", [1, 2, 5, 10, 20]
        )
        self._compile_time = histogram(
            "grammar_compile_time_seconds", "Grammar compile time.", COMPILE_BUCKETS
        )
        #: (engine index, engine_stats key[, position]) -> the last cumulative value seen.
        self._last: dict[tuple[Any, ...], float] = {}
        self._known_engines: set[int] = set()
        for engine_index in range(data_parallel_size):
            self._ensure_engine(engine_index)

    # Construction ------------------------------------------------------------------------
    def _metric(
        self, kind: type[Any], name: str, doc: str, extra_labels: Sequence[str] = ()
    ) -> Any:
        return kind(PREFIX + name, doc, [*LABELS, *extra_labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
        return Histogram(PREFIX + name, doc, LABELS, buckets=list(buckets), registry=self.registry)

    def _ensure_engine(self, engine_index: int) -> None:
        """Create the engine's series (finish reasons included), so they show 0 before use."""
        if engine_index in self._known_engines:
            return
        self._known_engines.add(engine_index)
        labels = (self.model_name, str(engine_index))
        for metric in (
            *self._gauges.values(),
            *self._counters.values(),
            self._prompt_tokens,
            self._generation_tokens,
            self._ttft,
            self._itl,
            self._e2e,
            self._queue_time,
            self._request_prompt_tokens,
            self._request_generation_tokens,
            self._request_max_tokens,
            self._request_n,
            self._compile_time,
        ):
            metric.labels(*labels)
        for reason in FINISH_REASONS:
            self._request_success.labels(*labels, reason)

    # Recording ---------------------------------------------------------------------------
    def record(
        self,
        engine_index: int,
        engine_stats: dict[str, Any] | None,
        iteration: IterationStats | None,
    ) -> None:
        """Apply one engine's stats and/or one batch of front-end measurements."""
        self._ensure_engine(engine_index)
        labels = (self.model_name, str(engine_index))
        if engine_stats:
            self._record_engine(engine_index, labels, engine_stats)
        if iteration is not None:
            self._record_iteration(labels, iteration)

    def _record_engine(
        self, engine_index: int, labels: tuple[str, str], stats: dict[str, Any]
    ) -> None:
        for key, gauge in self._gauges.items():
            if key in stats:
                gauge.labels(*labels).set(stats[key])
        for key, counter in self._counters.items():
            if key in stats:
                self._increase(counter.labels(*labels), (engine_index, key), stats[key])
        for position, value in enumerate(stats.get(PER_POS_KEY) or ()):
            child = self._accepted_per_pos.labels(*labels, str(position))
            self._increase(child, (engine_index, PER_POS_KEY, position), value)
        for key, value in (stats.get(TRANSFERS_KEY) or {}).items():
            name, _, tier = key.partition("@")
            if name in self._kv_transfers:
                child = self._kv_transfers[name].labels(*labels, tier or "all")
                self._increase(child, (engine_index, TRANSFERS_KEY, key), value)
        for seconds in stats.get("request_queue_time_s") or ():
            self._queue_time.labels(*labels).observe(seconds)
        for seconds in stats.get("grammar_compile_time_s") or ():
            self._compile_time.labels(*labels).observe(seconds)

    def _increase(self, child: Any, key: tuple[Any, ...], value: float) -> None:
        """Counter += (value - last value seen under `key`), if positive."""
        last = self._last.get(key, 0)
        self._last[key] = value
        if value > last:
            child.inc(value - last)

    def _record_iteration(self, labels: tuple[str, str], iteration: IterationStats) -> None:
        if iteration.num_prompt_tokens:
            self._prompt_tokens.labels(*labels).inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self._generation_tokens.labels(*labels).inc(iteration.num_generation_tokens)
        for seconds in iteration.time_to_first_tokens_s:
            self._ttft.labels(*labels).observe(seconds)
        for seconds in iteration.inter_token_latencies_s:
            self._itl.labels(*labels).observe(seconds)
        for finished in iteration.finished:
            reason = finished.finish_reason or "abort"
            self._request_success.labels(*labels, reason).inc()
            self._e2e.labels(*labels).observe(finished.e2e_latency_s)
            self._request_prompt_tokens.labels(*labels).observe(finished.num_prompt_tokens)
            self._request_generation_tokens.labels(*labels).observe(finished.num_generation_tokens)
            if finished.max_tokens is not None:
                self._request_max_tokens.labels(*labels).observe(finished.max_tokens)
            self._request_n.labels(*labels).observe(finished.n)

    def render(self) -> bytes:
        """The Prometheus text exposition of this logger's registry."""
        return generate_latest(self.registry)


class ConnectionGuardCollector:
    """`tandem:http_connections_closed_total{reason}`: connections the server's guard
    closed (`tandem.server.connection_guard`): `header_timeout` (headers not complete in
    time: slowloris) and `over_cap` (the longest-idle one evicted, or a new one refused,
    at the connection cap). Read from the guard's counters when scraped."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            PREFIX + "http_connections_closed",
            "Connections the server closed: headers too slow, or over the connection cap.",
            labels=["reason"],
        )
        family.add_metric(["header_timeout"], self.guard.closed_idle)
        family.add_metric(["over_cap"], self.guard.closed_over_cap)
        yield family


def watch_connection_guard(engine: Any, guard: Any) -> None:
    """Export `guard`'s closures on the `/metrics` of `engine` (its Prometheus logger)."""
    for logger in getattr(engine, "stat_loggers", ()):
        if isinstance(logger, PrometheusStatLogger):
            logger.registry.register(ConnectionGuardCollector(guard))
            return


def render_metrics(engine: Any) -> tuple[bytes, str]:
    """The `/metrics` response for `engine` (an AsyncLLM): (body, content type).

    Renders the first `PrometheusStatLogger` of `engine.stat_loggers`; an engine without
    one renders an empty exposition.
    """
    for logger in getattr(engine, "stat_loggers", ()):
        if isinstance(logger, PrometheusStatLogger):
            return logger.render(), CONTENT_TYPE_LATEST
    return generate_latest(CollectorRegistry()), CONTENT_TYPE_LATEST
