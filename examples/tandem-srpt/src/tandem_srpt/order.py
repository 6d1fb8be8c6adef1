"""`srpt-order`: WAITING shortest-remaining-processing-time first, with aging.

A policy plugin stacked with `reference-scheduler`: it answers one hook,
`make_waiting_queue`, with an `SRPTQueue`, and so changes only *which WAITING request is
admitted next*. Everything else (token budget, chunked prefill,
`long_prefill_token_threshold`, preemption by recompute, prefix caching, the placeholder
rules of async scheduling, stop checks) is the reference scheduler's, so the tokens each
request produces are exactly the reference ones; only the order (and so latency) changes.

    plugins: [reference-scheduler, {name: srpt-order, options: {aging_rate: 16.0}},
              default-sampler]

Policy. At scheduler step `now` (one `schedule` call), WAITING is served in increasing

    key(R) = W(R) - aging_rate * (now - s(R))

`W(R)` is R's remaining work in tokens (prompt still to prefill, plus `max_tokens` minus the
outputs so far, capped by `max_model_len`; see `tandem_srpt.queue.remaining_work`), `s(R)`
the step at which R entered the engine; a preempted request keeps its `s(R)`. Short requests
overtake long ones, but each waiting step lowers a request's key by `aging_rate` tokens.

Starvation bound. All waiting requests age at the same rate, so `key(R) = d(R) - aging_rate
* now` with the fixed virtual deadline `d(R) = W(R) + aging_rate * s(R)`, and WAITING is
served in increasing `d` (ties: insertion order). Every `W >= 1`, so a request X that
enters at `s(X) >= s(R) + (W(R) - 1) / aging_rate` has `d(X) >= d(R)` and never goes ahead
of R. Hence:

1. Overtaking window: only requests entering during the `H(R) = ceil((W(R) - 1) /
   aging_rate)` steps starting at `s(R)` can overtake R; since `W(R) <= max_model_len`,
   `H(R) <= ceil((max_model_len - 1) / aging_rate)` (4 steps for `max_model_len` 256 at the
   default 64 tokens per step). A request's wait is therefore never extended by the
   arrivals after its window, however many short requests keep coming.
2. Waiting steps: if at most `lam` requests enter per step, `Q` requests were waiting when R
   entered, `p` requests ordered ahead of R are preempted while R waits, and the engine
   admits WAITING's head at least once every `c` steps while R waits (a seat or KV blocks
   free up: `c` is at most the number of steps a running request ahead of R holds its
   seat), then at most `N = Q + lam * H(R) + p` requests are admitted before R and R waits
   at most `c * (N + 1) - 1` steps (0 = admitted at the first step after it arrived).

Under pure SRPT (`aging_rate -> 0`) `H` is unbounded and a long request starves under a
steady stream of short ones; `aging_rate` trades that bound against how strongly short
requests are favoured (a very large rate degenerates to FCFS).

Seams used: `make_waiting_queue` (the queue); `abort_requests` and `update_from_output`
(`trylast`, after the scheduler) only to forget the arrival step of requests that left.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field
from tandem.core import hookimpl
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin
from tandem.core.request import RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.schema.config import EngineConfig

from tandem_srpt.queue import SRPTQueue

__all__ = ["SRPTOptions", "SRPTOrder", "overtaking_window", "waiting_steps_bound"]


class SRPTOptions(BaseModel):
    """Options of `srpt-order` (the `options:` mapping of its stack entry)."""

    model_config = ConfigDict(extra="forbid")

    aging_rate: float = Field(
        64.0,
        gt=0,
        strict=True,
        allow_inf_nan=False,
        description="tokens of remaining work forgiven per step waited (> 0); bounds how "
        "long a long request can be overtaken: ceil((max_model_len - 1) / aging_rate) steps",
    )


def overtaking_window(remaining: int, aging_rate: float) -> int:
    """`H`: the number of steps, starting at a request's arrival step, during which later
    arrivals can still be ordered ahead of a request with `remaining` tokens of work."""
    return math.ceil((remaining - 1) / aging_rate)


def waiting_steps_bound(
    remaining: int,
    aging_rate: float,
    *,
    already_waiting: int,
    arrivals_per_step: int,
    admission_interval: int,
    preemptions_ahead: int = 0,
) -> int:
    """The most steps a request can wait in WAITING (see the module docstring, item 2)."""
    ahead = (
        already_waiting
        + arrivals_per_step * overtaking_window(remaining, aging_rate)
        + preemptions_ahead
    )
    return admission_interval * (ahead + 1) - 1


class SRPTOrder(TandemPlugin):
    """Supplies the scheduler's WAITING queue: remaining work minus aging, smallest first."""

    Options = SRPTOptions

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        if config.scheduler.scheduling_policy != "fcfs":
            raise PluginConfigError(
                f"scheduler.scheduling_policy: srpt-order orders WAITING by remaining work "
                f"and supports only 'fcfs' (arrival order breaks ties), got "
                f"{config.scheduler.scheduling_policy!r}"
            )
        super().__init__(config, options)
        assert isinstance(options, SRPTOptions)
        self.aging_rate = options.aging_rate
        #: The WAITING queue, once the scheduler asked for it (`make_waiting_queue`).
        self.queue: SRPTQueue | None = None

    def overtaking_window_steps(self) -> int:
        """The longest overtaking window any request can have in this engine."""
        return overtaking_window(self.config.max_model_len, self.aging_rate)

    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> SRPTQueue:
        self.queue = SRPTQueue(self.aging_rate, config.max_model_len)
        return self.queue

    # Forget the arrival step of requests that leave the engine ----------------------------
    @hookimpl
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        if self.queue is not None:
            self.queue.forget(request_ids)

    @hookimpl(trylast=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        if self.queue is not None:
            self.queue.forget_finished(scheduler_output.num_scheduled_tokens)
