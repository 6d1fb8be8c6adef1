"""The reference scheduler's numbers for the serving metrics (its `engine_stats` answer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.request import Request

if TYPE_CHECKING:
    from tandem.plugins.reference_scheduler import ReferenceScheduler


class SchedulerStats:
    """Queue-time observations, and the stats dict rendered from the scheduler's state.

    Queue time (vLLM's `request_queue_time_seconds`): from `Request.arrival_time` to the
    first time the request is scheduled, observed once per request (a request resumed after
    a preemption is not observed again). Observations are handed out once, by `render`.
    """

    def __init__(self) -> None:
        self._queue_times: list[float] = []

    def observe_first_scheduled(self, request: Request, now: float) -> None:
        """`request` was just admitted from WAITING for the first time since it arrived,
        at `now` on the engine clock (the clock of `request.arrival_time`)."""
        self._queue_times.append(max(now - request.arrival_time, 0.0))

    def render(self, scheduler: ReferenceScheduler) -> dict[str, object]:
        """The `engine_stats` keys the scheduler owns (see `core/hookspecs.py`).

        Gauges read now; `num_preemptions`, the prefix-cache counters (in tokens, only with
        prefix caching on) and the spec-decode counters (only with a drafter) are
        cumulative since start; `request_queue_time_s` holds the observations made since
        the previous call. O(running requests); no device work.
        """
        kv = scheduler.kv_cache_manager
        queue_times, self._queue_times = self._queue_times, []
        stats: dict[str, object] = {
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_output_placeholders": sum(r.num_output_placeholders for r in scheduler.running),
            "num_preemptions": scheduler.num_preemptions,
            "request_queue_time_s": queue_times,
        }
        if kv.enable_prefix_caching:
            stats["prefix_cache_queries"] = kv.prefix_cache_queries
            stats["prefix_cache_hits"] = kv.prefix_cache_hits
        if scheduler.kv_link.enabled:  # KV connector: tokens loaded, failed loads
            stats.update({f"kv_connector_{k}": v for k, v in scheduler.kv_link.stats.items()})
            stats["kv_connector_transfers"] = dict(scheduler.kv_link.transfers)
        if scheduler.config.speculative is not None:
            spec = scheduler.spec_metrics
            stats["spec_decode_num_drafts"] = spec.num_steps
            stats["spec_decode_num_draft_tokens"] = spec.num_draft_tokens
            stats["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens
            stats["spec_decode_num_accepted_tokens_per_pos"] = list(spec.accepted_per_position)
        return stats
