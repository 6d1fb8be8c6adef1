"""`LLM`: vLLM's offline surface over the tandem engine."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.core.config import EngineConfig, load_config
from tandem.core.engine_core import EngineCore, set_engine_threads
from tandem.core.executor import executor_class
from tandem.core.output_processor import OutputProcessor
from tandem.core.outputs import CompletionOutput, RequestOutput
from tandem.core.request import Request, RequestRejectedError
from tandem.core.resolve import resolve_config
from tandem.core.sampling_params import SEED_MAX, SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    """Load a model and a plugin stack, then generate.

    `LLM(model=..., config="stack.yaml", **overrides)`: keywords override config fields by
    name (`max_num_seqs=64`, `async_scheduling=False`, ...). `model="scripted"` runs the
    deterministic test model (token-id prompts only).
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
        set_engine_threads(1)
        source = str(config) if isinstance(config, (str, Path)) else "<config>"
        self.engine = EngineCore(self.config, source=source)
        self.tokenizer = None
        if self.config.model.model != "scripted":
            from pathlib import Path as _Path

            from tandem.core.model_files import load_tokenizer

            self.tokenizer = load_tokenizer(_Path(self.config.model.model))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompts: text prompts need a tokenizer; this model has none, pass token ids"
                )
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def _bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        """Tokenise `bad_words` (each word as written and with a leading space)."""
        if not params.bad_words or self.tokenizer is None:
            return params
        sequences: list[list[int]] = list(params.bad_words_token_ids)
        for word in params.bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False)["input_ids"]
                if ids and ids not in sequences:
                    sequences.append(ids)
        return params.model_copy(update={"bad_words_token_ids": sequences})

    def _add(
        self,
        rid: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> None:
        """Add one sequence. Its prompt is cut to the last `truncate_prompt_tokens` tokens
        (-1: `max_model_len - 1`, leaving one position for output); a seed past 2**64 - 1
        (child j of an `n > 1` request gets seed + j) wraps modulo 2**64."""
        params = self._bad_words_token_ids(params)
        if params.seed is not None and params.seed > SEED_MAX:
            params = params.model_copy(update={"seed": params.seed % (SEED_MAX + 1)})
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.config.max_model_len - 1 if keep == -1 else keep
            token_ids = token_ids[-keep:]
        request = Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.config.model.eos_token_id,
            arrival_time=time.monotonic(),
            priority=priority,
        )
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
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids or a dict with `prompt` or
        `prompt_token_ids`. `n > 1` runs n sequences that share the prompt's KV through
        prefix caching (seeded: sequence j uses seed + j). A bad prompt raises before any
        generation; requests already added for this call are aborted. A request a plugin
        rejects for a reason of its own (`RequestRejectedError`: e.g. a grammar its backend
        cannot compile) finishes with `finish_reason == "error"` and `error` set; the
        others run.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts"
            )
        groups: list[tuple[str, list[str]]] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True)):
                text, token_ids = self._prompt_token_ids(prompt)
                group_id = str(next(self._counter))
                children = [f"{group_id}-{j}" for j in range(p.n)] if p.n > 1 else [group_id]
                groups.append((group_id, children))
                for j, rid in enumerate(children):
                    child = p
                    if p.n > 1:
                        seed = None if p.seed is None else p.seed + j
                        child = p.model_copy(update={"n": 1, "seed": seed})
                    self._add(rid, text, token_ids, child, priority[i] if priority else 0)
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
        self._run(progress_total=sum(len(c) for _, c in groups) if use_tqdm else 0)
        return [self._merge(group_id, children) for group_id, children in groups]

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
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, formatted with the
        model's chat template. Each message needs `role` and `content`."""
        if self.tokenizer is None:
            raise ValueError(
                "chat: the model has no tokenizer (the scripted model takes token ids)"
            )
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for c, conversation in enumerate(conversations):  # type: ignore[arg-type]
            for m, message in enumerate(conversation):
                if (
                    not isinstance(message, dict)
                    or "role" not in message
                    or "content" not in message
                ):
                    raise ValueError(
                        f"messages[{c}][{m}]: expected a mapping with 'role' and 'content', got {message!r}"
                    )
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params)

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

    def _run(self, progress_total: int = 0) -> None:
        """Step until idle; with `progress_total`, draw a progress bar on stderr."""
        done = 0
        started = time.monotonic()
        while self.engine.has_work():
            outputs, _ = self.engine.step_fn()
            finished = self.output_processor.process(outputs)
            if progress_total and finished:
                done += len(finished)
                _draw_progress(done, progress_total, started)
            if self.output_processor.stopped_by_string:
                self.engine.abort_requests(self.output_processor.stopped_by_string)
                self.output_processor.stopped_by_string = []


def _draw_progress(done: int, total: int, started: float) -> None:
    width = 30
    filled = int(width * done / total)
    rate = done / max(time.monotonic() - started, 1e-9)
    end = "\n" if done >= total else ""
    print(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, {rate:.2f} req/s",
        end=end,
        file=sys.stderr,
        flush=True,
    )
