"""The hook contract between the tandem kernel and its plugins.

A plugin is a class. The plugin manager instantiates it as `cls(config, options)`, where
`config` is the resolved `EngineConfig` and `options` an instance of the class attribute
`Options` (a pydantic model; the default is an empty model that forbids extra keys), then
registers the instance with pluggy. Hooks are methods marked with `tandem.core.hookimpl`.

Order: the stack's order is call order. Broadcast hooks run every implementation in stack
order; for `firstresult` hooks the first plugin in stack order that returns a value other
than None answers and the rest are not called.

Same-seam policies: the policy seams compose by a rule per seam, stated in each docstring.
`requests_not_ready` is broadcast and the union is taken (any plugin may hold a request
back); `next_event_time` is broadcast and the earliest answer is taken.
`make_waiting_queue` and `select_preemption_victim` are exclusive (`EXCLUSIVE_SEAMS`): a
stack in which two plugins (other than the scheduler's own default) answer one of them is
refused at resolution, naming both, because a first answer would silently shadow the other
and neither answer can be refined without the other's state.

Failures: a hook implementation that raises is named in the error the caller sees
(`tandem.core.plugin_error.PluginError`: the plugin, the hook, its `file:line`, and the
engine step or phase). Stack resolution checks every implementation's signature against
its hookspec (pluggy's own check), so a misnamed argument fails before anything runs.

Two sides: engine-side hooks run in the engine process (the kernel calls them); worker-side
hooks (`sample`, `propose_drafts`) run wherever the model runs, on the worker's own plugin
manager, rebuilt from the resolved stack: no live plugin object crosses a process boundary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from tandem.kv.connector import KVConnectorSchedulerSpecs, KVConnectorWorkerSpecs

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    import torch

    from tandem.core.model_runner_output import ModelRunnerOutput, SamplerOutput
    from tandem.core.outputs import EngineCoreOutput, PluginFinish
    from tandem.core.plugin_manager import TandemPluginManager
    from tandem.core.request import Request, RequestStatus
    from tandem.core.scheduler_output import SchedulerOutput
    from tandem.core.scheduler_state import SchedulerState
    from tandem.core.waiting_queue import WaitingQueue
    from tandem.core.worker.draft_context import DraftContext
    from tandem.core.worker.sampling_metadata import SamplingMetadata
    from tandem.core.worker.step_shape import StepShape
    from tandem.schema.config import EngineConfig

PROJECT = "tandem"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class EngineHookSpecs(KVConnectorSchedulerSpecs):
    """Hooks the kernel calls in the engine process (the KV-connector ones inherited)."""

    @hookspec
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        """Registration hook: every plugin of the stack is registered and validated.

        Caller: the plugin manager, once, after `check_pending()`. Broadcast. A plugin may
        look up its peers (e.g. a grammar backend checks that the sampler applies bitmasks)
        and raise `PluginConfigError` naming them. Returns nothing.
        """

    @hookspec
    def add_request(self, request: Request) -> None:
        """A validated request enters the engine.

        Caller: the kernel, after it validated the request (prompt non-empty, shorter than
        `max_model_len`, token ids inside the vocabulary). Broadcast. The scheduler enqueues
        it in WAITING and registers it; a grammar backend may start compiling. A plugin may
        raise `ValueError` to reject the request: the kernel then aborts it in every plugin
        and reports the error to that request's caller only (`RequestRejectedError`, a
        `ValueError`, says the problem is this request's own: a front door reports it as
        that request's `finish_reason == "error"` and goes on with the others). A plugin
        that needs time before the request may run (a grammar compiling) reports it in
        `requests_not_ready` until it is ready.
        """

    @hookspec
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Requests leave the engine before finishing (client abort or a per-request error).

        Caller: the kernel, when it drains its aborts queue: at the start of a step and
        before every `update_from_output`. Broadcast. The scheduler sets `status`, removes
        the requests from its queues, frees their KV blocks *through the fence* and reports
        them in the next `SchedulerOutput.finished_req_ids`; other plugins drop their
        per-request state. Unknown or already finished ids are ignored.
        """

    @hookspec(firstresult=True)
    def schedule(self) -> SchedulerOutput | None:
        """Plan the next step.

        Caller: the kernel, once per step. First result wins: exactly one plugin (the
        scheduler) answers. It may mutate its queues, the KV cache manager and
        `num_cached_tokens`/status of requests, but NOT `num_computed_tokens` (that is
        `update_after_schedule`'s job, so every plugin there sees the pre-step ledger in the
        output). Returns a `SchedulerOutput`, possibly with zero tokens scheduled. The
        reference scheduler asks the policy hooks below while it plans.
        """

    # Policy seams: a scheduling policy is a plugin stacked on the reference scheduler ---
    @hookspec(firstresult=True)
    def make_waiting_queue(self, config: EngineConfig) -> WaitingQueue | None:
        """The queue that orders WAITING: the admission-order seam.

        Caller: the reference scheduler, once, in its `tandem_stack_loaded`, before any
        request arrives. First result wins; when every plugin returns None the scheduler
        uses its own FCFS or priority queue (`scheduler.scheduling_policy`). Returns a new,
        empty `tandem.core.waiting_queue.WaitingQueue` (its docstring is the contract:
        admission order, put-back, discard, the per-step clock `advance`); anything else is
        a `PluginConfigError` naming the plugin, and an exception raised here is a
        `PluginStartError` naming the plugin and this hook. The scheduler decides what
        enters and leaves the queue; the plugin may keep the object to read it. Every other
        rule stays the scheduler's (RUNNING first, budgets, admission stops at the first
        request that does not fit, none in a step that preempted), so tokens never change,
        only order.

        Exclusive: at most one plugin of a stack answers it (resolution refuses a second,
        naming both). A queue owns WAITING's order and its per-request state (ages,
        deadlines), so two orders cannot be chained by taking keys in turn; to combine
        rules, write one queue whose key is the tuple of both (e.g. a
        `tandem.plugins.request_queue.KeyedQueue` subclass).
        """

    @hookspec(firstresult=True)
    def select_preemption_victim(
        self, running: Sequence[Request], needed_by: Request
    ) -> Request | None:
        """The RUNNING request to preempt so that `needed_by` gets its KV blocks.

        Caller: the reference scheduler, while it plans a step, each time a KV allocation
        for the RUNNING request `needed_by` fails (again after every preemption, until it
        fits). First result wins; the scheduler itself answers last (`trylast`): FCFS
        `running[-1]` (the most recently admitted), priority the largest (priority,
        arrival_time). `running` is a snapshot of RUNNING in admission order, `needed_by`
        among them. The answer must be one of `running` (identity), possibly `needed_by`
        itself (it then waits for a later step), else the scheduler raises an error naming
        the plugin. Plugins change no request or queue: the scheduler preempts the victim
        by recompute (frees its blocks through the fence, resets its ledger, counts
        `num_preemptions`, puts it back with `WaitingQueue.prepend`).

        Starvation: the rule must bound how often one request is chosen while others run
        (e.g. not again once preempted k times while a fresher candidate exists), else a
        request can be recomputed without end; the conformance check `victim-starvation`
        fails a rule without such a bound.

        Exclusive: at most one plugin besides the scheduler answers it (resolution refuses
        a second, naming both): a later answer could only override the first, and a victim
        rule's bound holds only if it sees every choice. Combine rules in one plugin.
        """

    @hookspec
    def requests_not_ready(self) -> Collection[str] | None:
        """Requests a plugin is not ready for yet (a grammar compiling, a diffusion canvas
        being prepared, an external KV load in progress).

        Caller: the reference scheduler, once at the start of every `schedule` (not at all
        when no plugin implements it). Broadcast; each plugin returns the ids it is not
        ready for, or None, and the scheduler takes the union for that step only. Return a
        set-like collection the plugin already keeps (it is only read during the call's
        step). A WAITING request in it is skipped keeping its place, and never blocks the
        requests behind it. A RUNNING request in it is not scheduled this step: it keeps
        its KV blocks and ledger (results of a step in flight resolve its placeholders as
        usual) and later resumes exactly where it stopped; it may still be preempted. Ids
        the scheduler does not hold are ignored. A plugin that says "not yet" while
        nothing else can run implements `wait_for_work`, so the engine waits, not spins.
        """

    @hookspec
    def wait_for_work(self, timeout_s: float) -> None:
        """The engine is idle, waiting only for plugins: block until there is news.

        Caller: the kernel, after a step that scheduled nothing while requests are
        unfinished and no step with scheduled tokens is in flight (every request left is
        not ready). Broadcast. A plugin may block up to `timeout_s` seconds and returns as
        soon as it has news (a compile finished); with nothing pending it returns at once.
        It changes no request or queue: what it learned is applied at the next drain point
        (`poll_finished_requests`) and `requests_not_ready`. The only hook that may wait.
        """

    @hookspec
    def next_event_time(self) -> float | None:
        """On a virtual clock: when this plugin next changes what may run (a compile ending),
        else None. Caller: a simulation driver, after a step that ran nothing with requests
        unfinished and none in flight; broadcast, it moves the clock to the earliest answer.
        A plugin holding requests back without implementing it is polled. Changes nothing."""

    @hookspec
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance ledgers for what was just scheduled, before the step executes.

        Caller: the kernel, right after `schedule`, before `execute_model`. Broadcast in
        stack order, so the scheduler runs before any layer stacked after it. The scheduler
        adds `num_scheduled_tokens` to `num_computed_tokens` and `num_in_flight_tokens`,
        sets `is_prefill_chunk`, and marks the KV fence; the async layer then adds
        placeholders (it must run after `is_prefill_chunk` is known) and may set
        `pending_structured_output_tokens`; a grammar backend may mark its requests.
        """

    @hookspec(firstresult=True)
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """The token bitmask for the constrained requests of a step, or None.

        Caller: the kernel, before it asks the worker to sample that step; one step later
        when `pending_structured_output_tokens` is set (then the previous step's tokens are
        already applied). First result wins. Returns int32 `[num_rows, ceil(vocab/32)]`
        (bit `t % 32` of word `t // 32` set when token t is allowed). The runner places the
        rows at the batch's sampled rows; unconstrained rows allow every token.

        Rows: exactly `1 + len(scheduled_spec_decode_tokens.get(rid, ()))` for each `rid`
        of `scheduler_output.structured_output_request_ids`, in that order, always: the
        runner lays the rows out from the same list and rejects any other count. A request
        whose chunk does not sample still has its rows (they are ignored). Row j constrains
        the token after the request's confirmed tokens followed by its first j drafts: a
        backend fills draft rows by accepting drafts and must roll its matcher back after.

        Requests that left: the list is the step's as it was scheduled. When sampling was
        deferred, a request of it may have finished (the previous step's results stopped
        it) or been ended through `abort_requests` (a client abort or a plugin's finish,
        drained before that update) before this call: it is gone from the scheduler's
        registry and every plugin has already been told. Its rows must still be returned
        (all ones is right: its sampled tokens are discarded), and a backend must not look
        it up in state it dropped when the request left. The kernel does not filter the
        list (the worker's copy of the step could not follow).

        Drafts: under synchronous scheduling the scheduled drafts are the ones the worker
        verifies. Under async scheduling they are `-1` placeholders, and the worker
        verifies the request's latest proposal, which the scheduler recorded as
        `Request.draft_token_ids`; a backend gets the drafts of its rows with
        `drafts_to_verify(scheduled, request.draft_token_ids)`
        (`tandem.core.scheduler_output`, the helper the worker pads with) and keeps no copy
        of drafts (`tandem.testing.fake_grammar` is the worked example). The field is
        current: this hook runs for a step only after the step whose proposals it verifies
        has been through `update_from_output`. Requests that left are never looked up:
        their rows stay all ones, as above.
        """

    @hookspec
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput] | None:
        """A step's results are in.

        Caller: the kernel, in step order, after it drained the aborts queue. Broadcast in
        stack order; exactly one plugin (the scheduler) returns the per-request outputs,
        every other implementation returns None. The scheduler appends tokens, resolves
        placeholders, rolls rejected drafts back by the worker's explicit count
        (`model_runner_output.num_rejected_drafts`), records the drafter's next proposals
        (`draft_token_ids`), applies stop checks (trimming tokens after a
        stop), finishes and frees requests, and advances the KV fence; it skips requests
        that finished or were aborted while the step was in flight. Others (grammar,
        drafter metrics) observe or advance their own state.
        """

    @hookspec
    def poll_finished_requests(self) -> list[PluginFinish] | None:
        """Requests a plugin has ended on its own, outside any step's results.

        Caller: the kernel, at each drain point (the start of a step and before every
        `update_from_output`), right after it drains the aborts queue. Broadcast; each
        plugin returns the requests it ended since it was last asked (each at most once),
        or None. The kernel then finishes them exactly like an abort, with status
        `FINISHED_ERROR` (`finish_reason == "error"`, `PluginFinish.error` reported to the
        request's caller) or `FINISHED_STOPPED` ("stop"), through `abort_requests`, so
        the scheduler frees their KV through the fence; results of steps still in flight
        for them are dropped. Other requests are not affected. Unknown or already
        finished ids are ignored. Used by grammar backends for a grammar that failed to
        compile or timed out (error) and for a grammar that terminated on a request that
        does not stop at EOS (stop).
        """

    @hookspec(firstresult=True)
    def has_unfinished_requests(self) -> bool | None:
        """Whether any request is waiting or running. Caller: the kernel's loop control."""

    @hookspec(firstresult=True)
    def scheduler_state(self) -> SchedulerState | None:
        """A read-only view of the scheduler's requests, queues and KV cache manager.

        Caller: invariant checks, tests, tracing. First result wins. Callers must not
        mutate what they get.
        """

    @hookspec
    def engine_stats(self) -> dict[str, Any] | None:
        """This plugin's numbers for the serving metrics (vLLM's `SchedulerStats`).

        Caller: the engine-core process, after each step it reports and once when the
        engine goes idle. Broadcast; the kernel merges the dicts (a key belongs to one
        plugin) and adds `batch_queue_depth`. Values are gauges (`num_running_reqs`,
        `num_waiting_reqs`, `kv_cache_usage` in [0, 1], `num_output_placeholders`),
        cumulative counters since start (`prefix_cache_queries`/`_hits` in tokens,
        `num_preemptions`, `spec_decode_*`, `kv_connector_*`, the connector's worker counters
        `kv_connector_transfers` a dict (`get_kv_connector_stats`)), or lists of observations
        made since the previous call (`request_queue_time_s`, `grammar_compile_time_s`),
        each returned once. Must be cheap: no device sync.
        """


class WorkerHookSpecs(KVConnectorWorkerSpecs):
    """Hooks the model runner calls in the worker (the KV-connector ones inherited)."""

    @hookspec(firstresult=True)
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput | None:
        """Turn logits into token ids.

        Caller: the model runner, after the forward pass (and, under deferred sampling,
        one step later). First result wins. `logits` is float32 `[num_rows, vocab]`, one
        row per sampled position (for a request verifying k drafts: k + 1 rows, drafts
        first). The sampler applies, in this order, `metadata.logit_bias`,
        `allowed_token_ids`, `grammar_bitmask` (constrained rows), penalties and blocked
        tokens, then temperature (rows below `SAMPLING_EPS` are greedy), top-k/p and min-p,
        and draws a seeded row's randomness from (seed, output index): `metadata.seeded`
        marks seeded rows, whose `seeds` hold the seed's 64 bits as int64 (so -1 is a valid
        seed). It must not keep references to `logits`, and may change it in place only by
        masking (setting entries to -inf), since `logits` is sampled again after a failure.

        Failure: an exception fails the batch; the runner then samples each request alone
        and ends the ones that still raise with `finish_reason == "error"` (the others are
        sampled again together and go on). A plugin that raises must leave no partial state
        behind for a row it did not finish.

        Block diffusion (`worker/diffusion_runner.py`): `[R, L, V]` canvas logits with a
        `DenoiseMetadata` -> `DenoiseSamplerOutput`; empty with `InitialCanvasMetadata` -> `[R, L]`.
        """

    @hookspec(firstresult=True)
    def propose_drafts(self, context: DraftContext) -> list[list[int]] | None:
        """Propose draft tokens for the next step.

        Caller: the model runner, after sampling, once per step in step order (also for a
        step whose requests were all prefill chunks). First result wins. Returns one list per
        request in `context.req_ids` (possibly empty), at most `context.num_spec_tokens`
        long, or None when this plugin does not draft. `context.req_ids` holds every
        request of the step: those that did not sample (`sampled_token_ids` empty) get no
        drafts (their proposals are dropped), but a model-based drafter sees their tokens,
        the target's hidden states (if its class sets `needs_hidden_states = True`) and
        the step's batch to keep its own KV in step with the target's. A drafter frees its
        state for `context.finished_req_ids`; the target's KV layout (block ids, slot
        mapping) may index a drafter-owned pool, whose slots past a request's valid tokens
        are the drafter's to overwrite. A model-based drafter reads the target only through
        `context.target`, a `DraftTarget` (embedding, RoPE, whole-vocabulary logits,
        LM-head rows; collective under tensor parallelism, where every rank calls this hook
        alike). Under pipeline parallelism only the last stage calls it; its proposals
        reach the earlier stages with the step's sampled ids.
        """

    @hookspec(firstresult=True)
    def step_cost(self, step: StepShape) -> float | None:
        """Seconds the simulated device takes to run `step` (a cost model). Caller: the
        simulated executor, once per step; first result wins, None defers to the next
        plugin and, when none answers, to the roofline of `parallel.simulated_device`."""


HOOK_SPECS: tuple[type[Any], ...] = (EngineHookSpecs, WorkerHookSpecs)

#: The policy seams a stack lets at most one plugin answer (the scheduler's own default
#: aside), with what each decides; see the hooks' docstrings.
EXCLUSIVE_SEAMS: dict[str, str] = {
    "make_waiting_queue": "the WAITING admission order",
    "select_preemption_victim": "the preemption victim",
}
