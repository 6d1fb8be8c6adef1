"""`LLM`: vLLM's offline surface over the tandem engine.

The class is the front door's flow (load, add, step, collect); its helpers live beside it:
`llm_inputs.py` (argument checks), `chat_prompts.py` (conversations to prompts),
`generation_defaults.py` (the model's default sampling parameters), `llm_progress.py`
(the progress bar).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tandem.chat_prompts import chat_prompts
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore, EngineDeadError
from tandem.core.executor import executor_class
from tandem.core.worker.model_loader import model_loader_for
from tandem.generation_defaults import load_generation_defaults
from tandem.llm_inputs import (
    PromptType,
    _as_sampling_params,
    _priorities,
    _prompt_list,
)
from tandem.llm_progress import ProgressOption, _Progress
from tandem.output_processor import OutputProcessor
from tandem.request_builder import RequestBuilder
from tandem.schema.config import EngineConfig
from tandem.schema.outputs import CompletionOutput, RequestOutput
from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.sampling_params import SamplingParams
from tandem.stack_file import load_config

__all__ = ["LLM", "ProgressOption", "PromptType"]


class LLM:
    """Load a model and a plugin stack, then generate.

    `LLM(model=..., config="stack.yaml", **overrides)`: keywords override config fields by
    name (`max_num_seqs=64`, `async_scheduling=False`, `allow_download=True`, ...).
    `model` is `"default"` (the embedded SmolLM2), an HF directory, a `.gguf` file, a
    Hugging Face hub id from the local hub cache, or `"scripted"` (the deterministic test
    model, token-id prompts only). A model without tokenizer (its loader says so) takes
    token-id prompts and has no generation defaults.

    Plugins: `plugins=[...]` replaces the default stack; each entry is an installed
    plugin's name, an import path `"module:Class"`, a plugin class (registered by class,
    e.g. one under test, not yet packaged), or a `(name_or_class, options_dict)` pair, e.g.
    `LLM(model="scripted", plugins=[MyScheduler, ("default-sampler", {})])`. With
    `executor="process"` a class travels to the worker as its import path, so it must be
    defined at module level of an importable module (else a `PluginConfigError` naming it).

    Threads: the worker's torch threads resolve to `worker_num_threads` if given, else
    `OMP_NUM_THREADS`, else the CPUs this process may use. With the in-process (default)
    and thread executors the worker runs in this process, so that is this process's torch
    thread count; the engine itself never changes it.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        user_config = load_config(config, model=model, **overrides)
        executor_cls = executor_class(user_config.parallel.executor)
        supports_async = executor_cls.supports_async_scheduling if executor_cls else False
        self.config = resolve_config(user_config, executor_supports_async=supports_async)
        self._loader = model_loader_for(self.config.model.model)
        self._generation_defaults = load_generation_defaults(
            self.config, self._loader.has_tokenizer
        )
        # The tokenizer loads before the model: its parse transient then lands on a small
        # process and the freed heap is reused by the weights, not added on top of them.
        self.tokenizer = None
        if self._loader.has_tokenizer:
            from tandem.models.model_files import load_tokenizer

            self.tokenizer = load_tokenizer(Path(self.config.model.model))
        source = str(config) if isinstance(config, (str, Path)) else "<config>"
        self.engine = EngineCore(self.config, source=source)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._builder = RequestBuilder(self.config, self.tokenizer)
        self._counter = itertools.count()

    # vLLM's accessors -------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        """The model's (transformers) tokenizer; None for a model without tokenizer files
        and for the scripted model."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters `generate` and `chat` use when given none (vLLM's):
        with `model.generation_config == "auto"` the model's `generation_config.json`
        values of temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
        (as `max_tokens`) over `SamplingParams()`'s; with `"vllm"`, `SamplingParams()`.
        A fresh object each call."""
        return SamplingParams(**self._generation_defaults)

    # Prompts and parameters -------------------------------------------------------------
    def _add(
        self,
        rid: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> None:
        """Add one sequence (`RequestBuilder.build`: bad words, prompt truncation)."""
        request = self._builder.build(rid, token_ids, params, priority)
        token_ids, params = request.prompt_token_ids, request.sampling_params
        try:
            self.engine.add_request(request)
        except RequestRejectedError as exc:  # this request's own problem: report, go on
            self.output_processor.add_request(rid, text, token_ids, request.arrival_time, params)
            self.output_processor.fail(rid, str(exc))
            return
        self.output_processor.add_request(rid, text, token_ids, request.arrival_time, params)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams
        | Mapping[str, Any]
        | Sequence[SamplingParams | Mapping[str, Any]]
        | None = None,
        use_tqdm: ProgressOption = True,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order (vLLM's surface).

        A prompt is a string, a list of integer token ids or a dict with `prompt` or
        `prompt_token_ids`. `sampling_params`: one for all prompts or one per prompt, each a
        `SamplingParams` or a dict of its fields; None takes `get_default_sampling_params()`
        (the model's generation config). `use_tqdm`: a progress bar on stderr (True, the
        default), none (False), or a callable that makes a tqdm-like bar. `priority`: one
        integer per prompt (lower is served first under `scheduling_policy: priority`).
        `n > 1` runs n sequences that share the prompt's KV through prefix caching (seeded:
        sequence j uses (seed + j) mod 2**64).

        Bad input raises ValueError naming the argument (`prompts[2]`, `priority`,
        `sampling_params[1].temperature`) before anything runs; requests already added for
        this call are aborted. A request a plugin rejects for a reason of its own
        (`RequestRejectedError`: e.g. a grammar its backend cannot compile) finishes with
        `finish_reason == "error"` and `error` set; the others run.

        An engine-level failure (a step that raised in a way no single request explains:
        a plugin's hook, the scheduler, the forward pass) raises `EngineDeadError` (as
        vLLM's `LLM` does when its engine core dies) instead of returning outputs; its
        message names the plugin, the hook, its `file:line` and the step when a plugin
        raised (`__cause__` is the `tandem.core.plugin_error.PluginError`), and the
        progress bar stops where it was, marked failed. The `LLM` then refuses new work.
        """
        prompt_list = _prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        priorities = _priorities(priority, len(prompt_list))
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(
                "use_tqdm: expected True, False or a callable that makes a progress bar, got "
                f"{type(use_tqdm).__name__}"
            )
        prepared = [
            self._builder.prompt_token_ids(prompt, f"prompts[{i}]")
            for i, prompt in enumerate(prompt_list)
        ]
        groups: list[tuple[str, list[str]]] = []
        try:
            for (text, token_ids), p, prio in zip(prepared, params_list, priorities, strict=True):
                group_id = str(next(self._counter))
                children = [f"{group_id}-{j}" for j in range(p.n)] if p.n > 1 else [group_id]
                groups.append((group_id, children))
                for j, rid in enumerate(children):
                    self._add(rid, text, token_ids, p.child(j) if p.n > 1 else p, prio)
        except Exception:
            added = [
                rid
                for _, children in groups
                for rid in children
                if rid in self.output_processor.records
            ]
            self.engine.abort_requests(added)
            self._run()
            for rid in added:
                self.output_processor.pop(rid)
            raise
        progress = _Progress(use_tqdm, groups, self.output_processor) if use_tqdm else None
        try:
            self._run(progress)
        finally:
            if progress is not None:
                progress.close()
        if self.engine.dead_error is not None:
            for _, children in groups:
                for rid in children:
                    self.output_processor.records.pop(rid, None)
            raise EngineDeadError(self.engine.dead_error) from self.engine.dead_exception
        return [self._merge(group_id, children) for group_id, children in groups]

    def _params_list(
        self,
        sampling_params: SamplingParams
        | Mapping[str, Any]
        | Sequence[SamplingParams | Mapping[str, Any]]
        | None,
        num_prompts: int,
    ) -> list[SamplingParams]:
        """One validated `SamplingParams` per prompt (a dict is validated into one)."""
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, (SamplingParams, Mapping)):
            return [_as_sampling_params(sampling_params, "sampling_params")] * num_prompts
        if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
            raise ValueError(
                "sampling_params: expected SamplingParams, a dict of its fields or a list of "
                f"them (one per prompt), got {type(sampling_params).__name__}"
            )
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"sampling_params: got {len(sampling_params)} for {num_prompts} prompts; give "
                "one, or one per prompt"
            )
        return [
            _as_sampling_params(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)
        ]

    def _merge(self, group_id: str, children: list[str]) -> RequestOutput:
        outs = [self.output_processor.pop(rid) for rid in children]
        merged = outs[0]
        merged.request_id = group_id
        merged.outputs = [
            CompletionOutput(
                index=j,
                text=o.outputs[0].text,
                token_ids=o.outputs[0].token_ids,
                finish_reason=o.outputs[0].finish_reason,
                stop_reason=o.outputs[0].stop_reason,
                logprobs=o.outputs[0].logprobs,
                cumulative_logprob=o.outputs[0].cumulative_logprob,
            )
            for j, o in enumerate(outs)
        ]
        merged.finished = all(o.finished for o in outs)
        return merged

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams
        | Mapping[str, Any]
        | Sequence[SamplingParams | Mapping[str, Any]]
        | None = None,
        use_tqdm: ProgressOption = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's `LLM.chat`).

        Each message is a mapping with `role` and `content`. The prompt is the model's chat
        template applied to the conversation, or `chat_template` (a Jinja template string,
        or the path of a file holding one); `chat_template_kwargs` go to the template
        (e.g. `{"enable_thinking": False}`). `add_generation_prompt` opens the assistant's
        turn; `continue_final_message` instead continues the last (assistant) message, so
        the two exclude each other. `sampling_params` and `use_tqdm` are `generate`'s.
        """
        prompts = chat_prompts(
            self.tokenizer,
            messages,
            chat_template,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
        )
        return self.generate(prompts, sampling_params, use_tqdm)

    def spec_decode_metrics(self) -> dict[str, Any] | None:
        """Speculative-decoding counters since the engine started, or None without drafts:
        `num_verify_steps`, `num_draft_tokens`, `num_accepted_tokens`,
        `mean_acceptance_length` (tokens per verify step, accepted drafts + 1) and
        `acceptance_rate_per_position` (accepted at draft position j / verify steps)."""
        if self.config.speculative is None:
            return None
        for scheduler in self.engine.plugin_manager.plugins_with_role("scheduler"):
            metrics = getattr(scheduler, "spec_metrics", None)
            if metrics is not None:
                return dict(metrics.as_dict())
        return None

    def shutdown(self) -> None:
        """Stop the executor (a worker thread or process). Idempotent."""
        self.engine.shutdown()

    def _run(self, progress: _Progress | None = None) -> None:
        """Step until idle, reporting finished requests to `progress`."""
        while self.engine.has_work():
            outputs, _ = self.engine.run_step()
            finished = self.output_processor.process(outputs)
            if self.engine.dead_error is not None:  # nothing of this call succeeded
                if progress is not None:
                    progress.failed()
                return
            if progress is not None and finished:
                progress.finished(finished)
            if self.output_processor.ended_here:
                self.engine.abort_requests(list(self.output_processor.ended_here))
                self.output_processor.ended_here = {}
