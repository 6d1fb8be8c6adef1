"""The Prometheus stat logger: vLLM's metric names under `tandem:`, per-engine labels,
counters fed by differences of the engines' cumulative numbers, histograms fed by the
front end's measurements, and `/metrics` rendering; last, through a real AsyncLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.stats import FinishedRequestStats, IterationStats
from tandem.server.metrics import PrometheusStatLogger, render_metrics

MODEL = "scripted"

#: Every family the logger exposes (counter families without `_total`), with its type.
FAMILIES = {
    "tandem:num_requests_running": "gauge",
    "tandem:num_requests_waiting": "gauge",
    "tandem:kv_cache_usage_perc": "gauge",
    "tandem:batch_queue_depth": "gauge",
    "tandem:num_output_placeholders": "gauge",
    "tandem:prefix_cache_queries": "counter",
    "tandem:prefix_cache_hits": "counter",
    "tandem:num_preemptions": "counter",
    "tandem:engine_core_restarts": "counter",
    "tandem:prompt_tokens": "counter",
    "tandem:generation_tokens": "counter",
    "tandem:request_success": "counter",
    "tandem:spec_decode_num_drafts": "counter",
    "tandem:spec_decode_num_draft_tokens": "counter",
    "tandem:spec_decode_num_accepted_tokens": "counter",
    "tandem:spec_decode_num_accepted_tokens_per_pos": "counter",
    "tandem:kv_connector_external_hit_tokens": "counter",
    "tandem:kv_connector_failed_load_blocks": "counter",
    "tandem:kv_connector_rolled_back_requests": "counter",
    "tandem:kv_connector_loaded_tokens": "counter",
    "tandem:kv_connector_saved_tokens": "counter",
    "tandem:kv_connector_load_seconds": "counter",
    "tandem:kv_connector_save_seconds": "counter",
    "tandem:kv_connector_failed_loads": "counter",
    "tandem:time_to_first_token_seconds": "histogram",
    "tandem:inter_token_latency_seconds": "histogram",
    "tandem:e2e_request_latency_seconds": "histogram",
    "tandem:request_queue_time_seconds": "histogram",
    "tandem:request_prompt_tokens": "histogram",
    "tandem:request_generation_tokens": "histogram",
    "tandem:request_params_max_tokens": "histogram",
    "tandem:request_params_n": "histogram",
    "tandem:grammar_compile_time_seconds": "histogram",
}


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed from the text exposition."""
    text = logger.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(logger: PrometheusStatLogger, name: str, engine: int = 0, **labels: str) -> float:
    key = tuple(sorted({"model_name": MODEL, "engine": str(engine), **labels}.items()))
    return samples(logger)[(name, key)]


def finished(reason: str, e2e: float, prompt: int, generated: int) -> FinishedRequestStats:
    return FinishedRequestStats(reason, e2e, prompt, generated, max_tokens=16, n=1)


def test_every_family_exists_before_any_record_with_model_and_engine_labels() -> None:
    logger = PrometheusStatLogger(MODEL, max_model_len=256, data_parallel_size=2)
    text = logger.render().decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    # The text parser reads each counter's and histogram's `_created` line as a gauge.
    assert {n: t for n, t in families.items() if not n.endswith("_created")} == FAMILIES
    engines = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL
            engines.add(sample.labels["engine"])
    assert engines == {"0", "1"}
    assert value(logger, "tandem:request_success_total", finished_reason="stop") == 0


def test_cumulative_engine_counters_increase_by_their_difference_never_negatively() -> None:
    logger = PrometheusStatLogger(MODEL)
    for cumulative in (10, 25, 25):
        logger.record(0, {"prefix_cache_queries": cumulative, "num_preemptions": 1}, None)
    assert value(logger, "tandem:prefix_cache_queries_total") == 25
    assert value(logger, "tandem:num_preemptions_total") == 1
    logger.record(0, {"prefix_cache_queries": 5}, None)  # went down: the new baseline
    assert value(logger, "tandem:prefix_cache_queries_total") == 25
    logger.record(0, {"prefix_cache_queries": 8}, None)
    assert value(logger, "tandem:prefix_cache_queries_total") == 28


def test_each_engine_index_has_its_own_series_and_baseline() -> None:
    logger = PrometheusStatLogger(MODEL, data_parallel_size=2)
    logger.record(0, {"prefix_cache_hits": 40, "num_running_reqs": 3}, None)
    logger.record(1, {"prefix_cache_hits": 12, "num_running_reqs": 1}, None)
    logger.record(0, {"prefix_cache_hits": 44, "num_running_reqs": 2}, None)
    assert value(logger, "tandem:prefix_cache_hits_total", engine=0) == 44
    assert value(logger, "tandem:prefix_cache_hits_total", engine=1) == 12
    assert value(logger, "tandem:num_requests_running", engine=0) == 2
    assert value(logger, "tandem:num_requests_running", engine=1) == 1
    logger.record(3, {"num_waiting_reqs": 7}, None)  # an index not announced: new series
    assert value(logger, "tandem:num_requests_waiting", engine=3) == 7


def test_gauges_follow_the_latest_engine_stats() -> None:
    logger = PrometheusStatLogger(MODEL)
    busy = {
        "num_running_reqs": 4,
        "num_waiting_reqs": 2,
        "kv_cache_usage": 0.75,
        "batch_queue_depth": 2,
        "num_output_placeholders": 4,
    }
    logger.record(0, busy, None)
    assert value(logger, "tandem:kv_cache_usage_perc") == 0.75
    assert value(logger, "tandem:batch_queue_depth") == 2
    logger.record(0, dict.fromkeys(busy, 0), None)
    for name in ("num_requests_running", "kv_cache_usage_perc", "num_output_placeholders"):
        assert value(logger, f"tandem:{name}") == 0
    logger.record(0, {"num_preemptions": 1}, None)  # a dict without gauges keeps them
    assert value(logger, "tandem:num_requests_waiting") == 0


def test_spec_decode_counters_and_accepted_tokens_per_position() -> None:
    logger = PrometheusStatLogger(MODEL)
    logger.record(
        0, {"spec_decode_num_drafts": 3, "spec_decode_num_accepted_tokens_per_pos": [3, 1]}, None
    )
    logger.record(
        0, {"spec_decode_num_drafts": 5, "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}, None
    )
    assert value(logger, "tandem:spec_decode_num_drafts_total") == 5
    per_pos = [
        value(logger, "tandem:spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
        for j in range(3)
    ]
    assert per_pos == [4, 2, 1]


def test_observation_lists_are_observed_once_each() -> None:
    logger = PrometheusStatLogger(MODEL)
    logger.record(0, {"request_queue_time_s": [0.2, 0.9], "grammar_compile_time_s": [0.004]}, None)
    logger.record(0, {"request_queue_time_s": [], "grammar_compile_time_s": []}, None)
    assert value(logger, "tandem:request_queue_time_seconds_count") == 2
    assert value(logger, "tandem:request_queue_time_seconds_bucket", le="0.3") == 1
    assert value(logger, "tandem:grammar_compile_time_seconds_count") == 1
    assert value(logger, "tandem:grammar_compile_time_seconds_bucket", le="0.005") == 1


def test_iteration_stats_feed_tokens_latencies_and_finished_requests() -> None:
    logger = PrometheusStatLogger(MODEL, max_model_len=256)
    logger.record(
        0,
        None,
        IterationStats(
            engine_index=0,
            num_prompt_tokens=12,
            num_generation_tokens=5,
            time_to_first_tokens_s=[0.003, 0.05],
            inter_token_latencies_s=[0.02, 0.02, 0.3],
            finished=[finished("stop", 0.4, 7, 9), finished("length", 2.0, 5, 16)],
        ),
    )
    logger.record(0, None, IterationStats(engine_index=0, finished=[finished("abort", 0.1, 3, 0)]))
    assert value(logger, "tandem:prompt_tokens_total") == 12
    assert value(logger, "tandem:generation_tokens_total") == 5
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 2
    assert value(logger, "tandem:time_to_first_token_seconds_bucket", le="0.005") == 1
    assert value(logger, "tandem:inter_token_latency_seconds_count") == 3
    assert value(logger, "tandem:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(logger, "tandem:e2e_request_latency_seconds_count") == 3
    assert value(logger, "tandem:e2e_request_latency_seconds_bucket", le="0.5") == 2
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1), ("error", 0)):
        assert value(logger, "tandem:request_success_total", finished_reason=reason) == count
    assert value(logger, "tandem:request_prompt_tokens_sum") == 15
    assert value(logger, "tandem:request_generation_tokens_bucket", le="10.0") == 2
    assert value(logger, "tandem:request_params_max_tokens_count") == 3


def test_loggers_keep_their_own_registries_and_never_the_global_one() -> None:
    first, second = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    first.record(0, {"num_preemptions": 3}, None)
    assert value(first, "tandem:num_preemptions_total") == 3
    assert value(second, "tandem:num_preemptions_total") == 0
    assert REGISTRY.get_sample_value("tandem:num_preemptions_total") is None


def test_render_metrics_finds_the_prometheus_logger_among_the_engines_loggers() -> None:
    logger = PrometheusStatLogger(MODEL)
    logger.record(0, {"num_waiting_reqs": 5}, None)
    engine: Any = SimpleNamespace(stat_loggers=[object(), logger])
    body, content_type = render_metrics(engine)
    assert content_type.startswith("text/plain")
    assert 'tandem:num_requests_waiting{engine="0",model_name="scripted"} 5.0' in body.decode()
    assert render_metrics(SimpleNamespace(stat_loggers=[]))[0] == b""


def test_a_real_async_llm_reports_its_requests_and_an_empty_kv_pool_when_idle() -> None:
    from tandem.engine import AsyncLLM
    from tandem.schema.sampling_params import SamplingParams

    logger = PrometheusStatLogger(MODEL, max_model_len=256)
    engine = AsyncLLM(model="scripted", worker_num_threads=1, stat_loggers=[logger])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def run() -> None:
        async def one(i: int) -> None:
            async for _ in engine.generate([3 + i, 9, 11, 20], params, f"r{i}"):
                pass

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), timeout=60)
        for _ in range(500):  # the idle report arrives after the last outputs
            if value(logger, "tandem:num_requests_running") == 0 and (
                value(logger, "tandem:kv_cache_usage_perc") == 0
            ):
                return
            await asyncio.sleep(0.02)

    try:
        asyncio.run(run())
        text = render_metrics(engine)[0].decode()
    finally:
        engine.shutdown()
    assert 'tandem:kv_cache_usage_perc{engine="0",model_name="scripted"} 0.0' in text
    assert value(logger, "tandem:request_success_total", finished_reason="length") == 4
    assert value(logger, "tandem:prompt_tokens_total") == 16
    assert value(logger, "tandem:generation_tokens_total") == 24
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 4
    assert value(logger, "tandem:request_queue_time_seconds_count") == 4
    assert value(logger, "tandem:prefix_cache_queries_total") == 16
