"""`LLM`: vLLM's offline surface over the tandem engine."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.engine_core import EngineCore
from tandem.core.executor import executor_class
from tandem.core.request import Request, RequestRejectedError
from tandem.core.resolve import resolve_config
from tandem.core.worker.model_loader import model_loader_for
from tandem.output_processor import OutputProcessor
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams, SamplingParamsError
from tandem.stack_file import load_config

PromptType = str | Sequence[int] | dict[str, Any]
#: `use_tqdm`: True (tqdm's bar), False, or a callable that makes the bar (vLLM's shape,
#: e.g. `functools.partial(tqdm, leave=False)`).
ProgressOption = bool | Callable[..., Any]

logger = logging.getLogger("tandem.llm")


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
        self._generation_defaults = self._load_generation_defaults()
        source = str(config) if isinstance(config, (str, Path)) else "<config>"
        self.engine = EngineCore(self.config, source=source)
        self.tokenizer = None
        if self._loader.has_tokenizer:
            from tandem.core.worker.model_files import load_tokenizer

            self.tokenizer = load_tokenizer(Path(self.config.model.model))
        self.output_processor = OutputProcessor(self.tokenizer)
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

    def _load_generation_defaults(self) -> dict[str, Any]:
        from tandem.core.worker.model_files import generation_defaults

        choice = self.config.model.generation_config
        if choice == "vllm" or (choice == "auto" and not self._loader.has_tokenizer):
            return {}
        directory = Path(self.config.model.model if choice == "auto" else choice).expanduser()
        if choice != "auto" and not (directory / "generation_config.json").exists():
            raise ConfigError(
                f"model.generation_config: {choice!r} is not 'auto', 'vllm' or a directory "
                "holding a generation_config.json"
            )
        defaults = generation_defaults(directory)
        try:
            SamplingParams(**defaults)
        except ValueError as exc:  # SamplingParamsError: one line per bad field
            where = f"model.generation_config: {directory / 'generation_config.json'}:"
            raise ConfigError(str(exc).replace("SamplingParams:", where)) from None
        if defaults:
            logger.info(
                "default sampling parameters from %s: %s (used when no SamplingParams is "
                "given; generation_config='vllm' turns them off)",
                directory / "generation_config.json",
                defaults,
            )
        return defaults

    # Prompts and parameters -------------------------------------------------------------
    def _prompt_token_ids(self, prompt: PromptType, where: str) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; `where` names it in errors (`prompts[3]`)."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
                return prompt.get("prompt"), ids
            if "prompt" not in prompt:
                raise ValueError(
                    f"{where}: expected a dict with 'prompt' or 'prompt_token_ids', got "
                    f"keys {sorted(map(str, prompt))}"
                )
            prompt, where = prompt["prompt"], f"{where}['prompt']"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: text prompts need a tokenizer; this model has none, pass token ids"
                )
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError(f"{where}: the prompt is empty (no tokens)")
            return prompt, ids
        return None, _token_ids(prompt, where)

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
        (-1: `max_model_len - 1`, leaving one position for output)."""
        params = self._bad_words_token_ids(params)
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
            self._prompt_token_ids(prompt, f"prompts[{i}]") for i, prompt in enumerate(prompt_list)
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
        if self.tokenizer is None:
            raise ValueError(
                "chat: the model has no tokenizer (the scripted model takes token ids)"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message: True needs add_generation_prompt=False (continue the "
                "last message, or open a new assistant turn, not both)"
            )
        template = _chat_template(chat_template)
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "chat_template: the model's tokenizer has no chat template; pass one "
                "(chat_template='{% for m in messages %}...')"
            )
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                "messages: expected a conversation (a list of {'role', 'content'} mappings) "
                f"or a list of conversations, got {messages!r}"
            )
        conversations = [messages] if isinstance(messages[0], Mapping) else messages
        prompts = []
        for c, conversation in enumerate(conversations):  # type: ignore[arg-type]
            if not isinstance(conversation, list) or not conversation:
                raise ValueError(
                    f"messages[{c}]: expected a non-empty list of messages, got {conversation!r}"
                )
            for m, message in enumerate(conversation):
                if (
                    not isinstance(message, Mapping)
                    or "role" not in message
                    or "content" not in message
                ):
                    raise ValueError(
                        f"messages[{c}][{m}]: expected a mapping with 'role' and 'content', got {message!r}"
                    )
            text = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
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
            if progress is not None and finished:
                progress.finished(finished)
            if self.output_processor.stopped_by_string:
                self.engine.abort_requests(self.output_processor.stopped_by_string)
                self.output_processor.stopped_by_string = []


class _Progress:
    """vLLM's progress bar: prompts processed (a prompt with n > 1 counts once, when its
    last sequence ends) and the estimated input and output token rates."""

    def __init__(
        self,
        use_tqdm: ProgressOption,
        groups: list[tuple[str, list[str]]],
        output_processor: OutputProcessor,
    ) -> None:
        if callable(use_tqdm):
            factory = use_tqdm
        else:
            from tqdm.auto import tqdm as factory
        self.records = output_processor.records
        self.group_of = {rid: gid for gid, children in groups for rid in children}
        self.remaining = {gid: len(children) for gid, children in groups}
        self.input_tokens = 0
        self.output_tokens = 0
        self.started = time.perf_counter()
        self.bar = factory(
            total=len(groups),
            desc="Processed prompts",
            dynamic_ncols=True,
            postfix=_speed(0.0, 0.0),
        )
        # Requests a plugin refused at add_request finished before the first step.
        self.finished([rid for rid, record in self.records.items() if record.finish_reason])

    def finished(self, request_ids: list[str]) -> None:
        done = 0
        for rid in request_ids:
            gid = self.group_of.pop(rid, None)
            if gid is None:
                continue
            record = self.records[rid]
            self.input_tokens += len(record.prompt_token_ids)
            self.output_tokens += len(record.token_ids)
            self.remaining[gid] -= 1
            done += self.remaining[gid] == 0
        if done:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.postfix = _speed(self.input_tokens / elapsed, self.output_tokens / elapsed)
            self.bar.update(done)

    def close(self) -> None:
        self.bar.close()


def _speed(input_rate: float, output_rate: float) -> str:
    return f"est. speed input: {input_rate:.2f} toks/s, output: {output_rate:.2f} toks/s"


# Argument checks: each raises ValueError naming the argument --------------------------
def _prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list: one string, dict or token-id list becomes a list of one."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts: expected a string, a list of token ids, a dict with 'prompt' or "
            f"'prompt_token_ids', or a list of these, got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts: expected at least one prompt, got an empty list")
    if isinstance(prompts[0], Real):  # one prompt of token ids (floats are refused there)
        return [prompts]
    return list(prompts)


def _token_ids(value: Any, where: str) -> list[int]:
    """A prompt's token ids as Python ints; floats, bools and anything else are refused
    (never truncated)."""
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        raise ValueError(f"{where}: expected a list of integer token ids, got {value!r}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: expected a list of integer token ids ({exc})") from exc
    if array.ndim != 1:
        raise ValueError(
            f"{where}: expected a flat list of integer token ids, got {array.ndim} dimensions"
        )
    if array.size == 0:
        raise ValueError(f"{where}: the prompt is empty (no token ids)")
    if array.dtype.kind not in "iu":
        found = next(
            (
                (i, t)
                for i, t in enumerate(value.tolist() if hasattr(value, "tolist") else value)
                if isinstance(t, bool) or not isinstance(t, Integral)
            ),
            None,
        )
        if found is None:  # integers too large for int64
            raise ValueError(f"{where}: token id {max(array.tolist())} is out of range")
        raise ValueError(
            f"{where}: token ids must be integers, got {found[1]!r} "
            f"({type(found[1]).__name__}) at position {found[0]}"
        )
    return array.tolist()


def _priorities(priority: Any, num_prompts: int) -> list[int]:
    """One integer per prompt (all 0 when None)."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, (str, bytes, Mapping)) or not isinstance(priority, Sequence):
        raise ValueError(f"priority: expected a list of integers, one per prompt, got {priority!r}")
    if len(priority) != num_prompts:
        raise ValueError(
            f"priority: got {len(priority)} values for {num_prompts} prompts; give one per prompt"
        )
    for i, p in enumerate(priority):
        if isinstance(p, bool) or not isinstance(p, Integral):
            raise ValueError(f"priority[{i}]: expected an integer, got {p!r}")
    return [int(p) for p in priority]


def _as_sampling_params(value: Any, where: str) -> SamplingParams:
    """A `SamplingParams` as given, or a dict of its fields validated into one."""
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        try:
            return SamplingParams(**{str(k): v for k, v in value.items()})
        except ValueError as exc:  # SamplingParamsError: one line per bad field
            message = str(exc).replace("SamplingParams:", f"{where}:")
            raise SamplingParamsError(message) from None
    raise ValueError(
        f"{where}: expected SamplingParams or a dict of its fields, got {type(value).__name__}"
    )


def _chat_template(chat_template: str | None) -> str | None:
    """A template string as given, or the contents of the file it names."""
    if chat_template is None or "{" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(
        f"chat_template: expected a Jinja template string or an existing file, got {chat_template!r}"
    )
