"""Completing a config on the front door: model limits, KV pool, async mode, the stack.

`resolve_config` (vLLM's `EngineArgs.create_engine_config`) fills every `None` that has a
computable value: the model's loader (`worker.model_loader`) fills vocabulary, EOS,
`max_model_len` and the KV pool; then `async_scheduling`: None resolves to on unless an
option is incompatible (then off, with a log line naming it); True with an incompatible
option is an error naming it. Incompatible: an executor without async support, pipeline
parallelism, a drafter that declares `aligned_drafts = False`.

Last it resolves the plugin stack once (names to classes through discovery, implied
plugins, options, conflicts) and keeps it on the config (`keep_stack`);
the engine's and the worker's plugin managers only read it. The kernel receives a resolved
config and never discovers plugins.
"""

from __future__ import annotations

import logging
import math

from tandem.core.executor import executor_class
from tandem.core.plugin_manager import (
    PluginConfigError,
    ResolvedStack,
    StackEntry,
    capability,
    implemented_hooks,
    import_class,
    stack_entry,
)
from tandem.core.worker.model_loader import model_loader_for
from tandem.core.worker.threads import resolve_worker_threads
from tandem.kv.connector import KV_CONNECTOR_ALIASES
from tandem.plugin_discovery import load_plugin_class, loadable_plugins
from tandem.plugins import kv_multi_children
from tandem.schema.config import ConfigError, EngineConfig, PluginSpec, class_path, with_line
from tandem.schema.diffusion_config import DiffusionConfig
from tandem.stack_checks import check_exclusive_seams, check_signatures

logger = logging.getLogger("tandem.config")


def async_incompatibility(stack: ResolvedStack) -> str | None:
    """The plugin that rules async scheduling out, in words, or None."""
    drafter = stack.drafter
    if drafter is not None and not drafter.cap("aligned_drafts"):
        return f"drafter {drafter.name!r} (its drafts are not aligned with the sampled tokens)"
    return None


def _declared(role: str, attr: str, value: str) -> tuple[list[str], list[str]]:
    """(installed plugins of `role` declaring `value` in `attr`, every value declared)."""
    found = [(n, c) for n, c in loadable_plugins().items() if capability(c, "role") == role]
    names = sorted({v for _, c in found for v in capability(c, attr)})
    return [n for n, c in found if value in capability(c, attr)], names


def _one_declaring(field: str, role: str, attr: str, value: str, required: bool) -> str | None:
    claimants, declared = _declared(role, attr, value)
    if len(claimants) > 1:
        raise PluginConfigError(
            f"{field}: {value!r} is declared by {len(claimants)} installed {role} plugins "
            f"({', '.join(claimants)}); name the one to use in plugins"
        )
    if not claimants and required:
        raise PluginConfigError(
            f"{field}: no installed {role} plugin declares {value!r}; declared: "
            f"{', '.join(declared) or 'none'}"
        )
    return claimants[0] if claimants else None


def default_for(role: str) -> str:
    """The installed plugin declaring itself the default of `role` (`default_for_role`)."""
    named = [
        n
        for n, c in loadable_plugins().items()
        if capability(c, "role") == role and capability(c, "default_for_role")
    ]
    if len(named) != 1:
        raise PluginConfigError(
            f"plugins: {len(named)} installed plugins declare themselves the default {role} "
            f"({', '.join(named) or 'none'}); name the stack's plugins explicitly"
        )
    return named[0]


# --- issue 15 (diffusion), additive -------------------------------------------------------
def diffusion_default_for(role: str) -> str:
    """The installed plugin of `role` declaring `diffusion_default = True`."""
    named = [
        n
        for n, c in loadable_plugins().items()
        if capability(c, "role") == role and getattr(c, "diffusion_default", False)
    ]
    if len(named) != 1:
        raise PluginConfigError(
            f"plugins: {len(named)} installed plugins declare themselves the diffusion {role} "
            f"({', '.join(named) or 'none'}); name the stack's plugins explicitly"
        )
    return named[0]


def check_diffusion(config: EngineConfig, loader: type, explicit: bool) -> None:
    """A loader declaring `is_diffusion` makes the model a block-diffusion model: its
    `diffusion` section must resolve (the loader fills the model's defaults); a `diffusion`
    section on any other model, and drafts with a diffusion model, are errors naming the key."""
    if not getattr(loader, "is_diffusion", False):
        if explicit:
            raise ConfigError(
                f"diffusion: model {config.model.model!r} is not a diffusion model; remove "
                "the diffusion section (diffusion_config)"
            )
        return
    if config.diffusion is None:
        config.diffusion = DiffusionConfig()
    try:
        config.diffusion.check_resolved()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.speculative is not None:
        raise ConfigError(
            "speculative: drafts do not apply to a diffusion model (its canvas positions "
            "already travel on the draft path); remove speculative (speculative_config)"
        )
    canvas = config.diffusion.canvas_length
    assert canvas is not None
    if config.scheduler.max_num_batched_tokens < canvas:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens: {config.scheduler.max_num_batched_tokens} "
            f"cannot hold one canvas of diffusion.canvas_length {canvas}"
        )


def check_diffusion_stack(config: EngineConfig, stack: ResolvedStack) -> None:
    """A diffusion model needs a scheduler sampling 0 tokens per step (canvases only)."""
    if config.diffusion is None:
        return
    for entry in stack.with_role("scheduler"):
        if getattr(entry.cls, "num_sampled_tokens_per_step", 1) != 0:
            raise PluginConfigError(
                f"{config.source}: plugins: {entry.name} is an autoregressive scheduler; a "
                f"diffusion model needs {diffusion_default_for('scheduler')!r}"
            )


# -------------------------------------------------------------------------------------------
def default_stack(config: EngineConfig) -> list[PluginSpec]:
    """The stack used when the config names none: the default scheduler and sampler (the
    plugins declaring `default_for_role`), the grammar plugin declaring
    `structured_output.backend` when the model's loader says it has a tokenizer (or the
    plugin needs none), and the drafter declaring `speculative.method` when speculative
    decoding is configured. The kernel names no plugin: each declares what it answers."""
    if config.diffusion is not None:  # issue 15: a block-diffusion model
        return [PluginSpec(name=diffusion_default_for(r)) for r in ("scheduler", "sampler")]
    stack = [PluginSpec(name=default_for("scheduler")), PluginSpec(name=default_for("sampler"))]
    backend = config.structured_output.backend
    grammar = _one_declaring(
        "structured_output.backend", "grammar", "grammar_backends", backend, backend != "auto"
    )
    if grammar is not None and (
        model_loader_for(config.model.model).has_tokenizer
        or not capability(loadable_plugins()[grammar], "needs_tokenizer")
    ):
        stack.append(PluginSpec(name=grammar))
    if config.speculative is not None:
        method = config.speculative.method
        drafter = _one_declaring(
            "speculative.method", "drafter", "speculative_methods", method, True
        )
        stack.append(PluginSpec(name=drafter))
    return stack


def _entry(config: EngineConfig, spec: PluginSpec, where: str) -> StackEntry:
    cls = spec.plugin if isinstance(spec.plugin, type) else None
    if cls is None:
        path = spec.plugin if isinstance(spec.plugin, str) else None
        cls = load_plugin_class(path or spec.name, f"{where}.name")
    entry = stack_entry(cls, spec, where)
    check_signatures(cls, spec, where)
    return entry


def _check_roles(config: EngineConfig, stack: ResolvedStack, source: str) -> None:
    for role in ("scheduler", "async-layer", "sampler", "drafter", "grammar", "kv-connector"):
        named = [e.name for e in stack.with_role(role)]
        if len(named) > 1:
            raise PluginConfigError(
                f"{source}: plugins: {len(named)} plugins claim the {role} role "
                f"({', '.join(named)}); a stack has at most one {role}"
            )
    if not stack.with_role("scheduler"):
        raise PluginConfigError(f"{source}: plugins: the stack has no scheduler plugin")
    drafter, spec = stack.drafter, config.speculative
    if spec is not None and drafter is None:
        suggestion, _ = _declared("drafter", "speculative_methods", spec.method)
        raise PluginConfigError(
            f"{source}: speculative: method {spec.method!r} is configured but the stack "
            f"({', '.join(e.name for e in stack.entries)}) has no drafter plugin; add "
            f"{' or '.join(map(repr, suggestion)) or 'a drafter declaring it'} to plugins"
        )
    if spec is None and drafter is not None:
        raise PluginConfigError(
            f"{source}: plugins: the drafter {drafter.name!r} needs a speculative section "
            "(speculative: {method: ..., num_speculative_tokens: k}), but none is configured"
        )
    if spec is not None and drafter is not None:
        _check_declares("speculative.method", spec.method, drafter, "speculative_methods")


def _check_declares(field: str, value: str, entry: StackEntry, attr: str) -> None:
    """A plugin that declares names must declare the configured one."""
    declared = tuple(entry.cap(attr))  # type: ignore[call-overload]
    if declared and value not in declared:
        raise PluginConfigError(
            f"{entry.where}: {field} is {value!r} but {entry.name} declares {', '.join(declared)}"
        )


def _check_grammar(config: EngineConfig, stack: ResolvedStack, source: str) -> None:
    backend = config.structured_output.backend
    grammar = next(iter(stack.with_role("grammar")), None)
    if grammar is None:
        if backend != "auto":
            _one_declaring(
                "structured_output.backend", "grammar", "grammar_backends", backend, True
            )
        return
    if backend != "auto":
        _check_declares("structured_output.backend", backend, grammar, "grammar_backends")
    loader = model_loader_for(config.model.model)
    if grammar.cap("needs_tokenizer") and not (loader.has_tokenizer or config.model.tokenizer):
        raise PluginConfigError(
            f"{grammar.where}: {grammar.name} needs a model with a tokenizer; the "
            f"{config.model.model!r} model has none (set model.tokenizer)"
        )
    if not stack.applies_grammar_bitmask:
        samplers = [e.name for e in stack.with_role("sampler")]
        raise PluginConfigError(
            f"{source}: plugins: the grammar backend {grammar.name} needs a sampler "
            "that applies grammar bitmasks (`applies_grammar_bitmask = True`), but "
            + (f"{samplers[0]} does not" if samplers else "the stack has no sampler")
        )


def _check_process_paths(config: EngineConfig, stack: ResolvedStack) -> None:
    """With the process executor every class travels as `module:Class`: it must import."""
    if executor_class(config.parallel.executor).runs_in_caller_process:
        return
    for entry in stack.entries:
        path = class_path(entry.cls)
        try:
            importable = "<locals>" not in path and not path.startswith("__main__:")
            importable = importable and import_class(path) is entry.cls
        except Exception:
            importable = False
        if not importable:
            raise PluginConfigError(
                f"{entry.where}: plugin {entry.name!r} ({path}) cannot be imported by its "
                "path, and parallel.executor "
                f"{config.parallel.executor!r} rebuilds the stack in another process; define the class at module level of an importable module"
            )


def _base_entries(config: EngineConfig, source: str) -> list[StackEntry]:
    """The named (or default) stack's entries: classes found, options validated; then the
    connector `kv_transfer` names, if any."""
    specs = list(config.plugins) if config.plugins is not None else default_stack(config)
    entries = [
        _entry(config, spec, f"{with_line(source, config._lines, ('plugins', i))}: plugins[{i}]")
        for i, spec in enumerate(specs)
    ]
    transfer = config.kv_transfer
    if transfer is not None:
        name = KV_CONNECTOR_ALIASES.get(transfer.kv_connector, transfer.kv_connector)
        spec = PluginSpec(name=name, options=transfer.kv_connector_extra_config)
        entry = _entry(config, spec, f"{source}: kv_transfer.kv_connector")
        if entry.cap("role") != "kv-connector":
            raise PluginConfigError(
                f"{source}: kv_transfer.kv_connector: {transfer.kv_connector!r} is not a KV "
                "connector plugin (role kv-connector)"
            )
        entries.append(entry)
    return entries


def _finish(config: EngineConfig, entries: list[StackEntry], source: str) -> ResolvedStack:
    """Insert the implied async layer and reject conflicts."""
    stack = ResolvedStack(tuple(entries))
    layers, schedulers = stack.with_role("async-layer"), stack.with_role("scheduler")
    if config.scheduler.async_scheduling and not layers and schedulers:
        name = default_for("async-layer")
        implied = f"{source}: plugin {name!r} (implied by the stack)"
        layer = _entry(config, PluginSpec(name=name), implied)
        index = entries.index(schedulers[0]) + 1
        stack = ResolvedStack((*entries[:index], layer, *entries[index:]))
    if not config.scheduler.async_scheduling and layers:
        raise PluginConfigError(
            f"{source}: plugins: {layers[0].name} needs scheduler.async_scheduling: true"
        )
    _check_roles(config, stack, source)
    check_exclusive_seams(stack)
    _check_grammar(config, stack, source)
    _check_process_paths(config, stack)
    if not any("sample" in implemented_hooks(e.cls) for e in stack.entries):
        raise PluginConfigError(
            f"{source}: plugins: the stack has no sampler (no plugin implements "
            f"`sample`); add {default_for('sampler')!r}"
        )
    return stack


def resolve_stack(config: EngineConfig, source: str | None = None) -> ResolvedStack:
    """Resolve names to classes, validate options, add implied plugins, reject conflicts.

    The default async layer (`default_for_role`) is inserted right after the scheduler when
    `scheduler.async_scheduling` is true and the stack does not name an async layer.
    Errors name the stack file's line and entry (`file:N: plugins[i]`)."""
    source = source or config.source
    return _finish(config, _base_entries(config, source), source)


def keep_stack(config: EngineConfig, stack: ResolvedStack) -> ResolvedStack:
    """Keep `stack` on `config`, with its serialisable form in `config.resolved_stack`."""
    config._stack = stack
    config.resolved_stack = [
        PluginSpec(name=e.name, options=e.raw_options, plugin=e.cls) for e in stack.entries
    ]
    return stack


def _resolve_async(config: EngineConfig, executor_supports_async: bool) -> bool:
    """Decide `async_scheduling`; with speculative decoding the drafter has a say, so the
    stack is resolved here (once: it is kept on the config)."""
    requested, incompatible, entries = config.scheduler.async_scheduling, None, None
    if not executor_supports_async:
        incompatible = f"executor {config.parallel.executor!r} without async scheduling support"
    elif config.speculative is not None and requested is not False:
        entries = _base_entries(config, config.source)
        incompatible = async_incompatibility(ResolvedStack(tuple(entries)))
    if requested and incompatible:
        raise ConfigError(f"scheduler.async_scheduling: true is not supported with {incompatible}")
    if requested is None and incompatible:
        logger.info("async scheduling disabled: %s", incompatible)
    decided = not incompatible if requested is None else requested
    if entries is not None:
        config.scheduler.async_scheduling = decided
        keep_stack(config, _finish(config, entries, config.source))
    return decided


def _resolve_parallel(config: EngineConfig, loader: type) -> None:
    """Ranks: more than one picks the `mp` executor unless one is named, which must run
    that many ranks; the model's loader must declare `supports_tensor_parallel` /
    `supports_pipeline_parallel`; what does not combine with ranks yet is refused naming
    both keys."""
    parallel = config.parallel
    world = parallel.world_size
    if world == 1:
        return
    if "executor" not in parallel.model_fields_set:
        parallel.executor = "mp"
    cls = executor_class(parallel.executor)
    if cls.max_world_size is not None and world > cls.max_world_size:
        raise ConfigError(
            f"parallel.world_size: {world} ranks (tensor_parallel_size x "
            "pipeline_parallel_size) need a multi-rank executor; "
            f"parallel.executor {parallel.executor!r} runs at most {cls.max_world_size} "
            "(use 'mp')"
        )
    if parallel.cpu_bind != "none":
        raise ConfigError(
            "parallel.cpu_bind: pinning is per process and is not supported with "
            f"parallel.world_size {world} (leave it 'none')"
        )
    if parallel.tensor_parallel_size > 1 and not getattr(loader, "supports_tensor_parallel", False):
        raise ConfigError(
            f"parallel.tensor_parallel_size: {parallel.tensor_parallel_size} is not supported by "
            f"the model loader of model.model {config.model.model!r} ({loader.__name__} does "
            "not declare supports_tensor_parallel)"
        )
    pp = parallel.pipeline_parallel_size
    if pp > 1 and not getattr(loader, "supports_pipeline_parallel", False):
        raise ConfigError(
            f"parallel.pipeline_parallel_size: {pp} is not supported by the model loader of "
            f"model.model {config.model.model!r} ({loader.__name__} does not declare "
            "supports_pipeline_parallel)"
        )
    spec = config.speculative
    if spec is not None and pp > 1 and spec.method != "ngram":
        raise ConfigError(
            f"speculative.method: {spec.method!r} reads the target's embedding and hidden "
            f"states, which parallel.pipeline_parallel_size {pp} puts on different stages; "
            "only 'ngram' runs with pipeline parallelism"
        )


def resolve_config(config: EngineConfig, executor_supports_async: bool = True) -> EngineConfig:
    """Return a copy with every `None` that has a computable value filled in and the
    plugin stack resolved and kept on it (`plugin_manager.stack_of` reads it)."""
    config = config.model_copy(deep=True)
    config._stack, config.resolved_stack = None, None
    model = config.model
    loader = model_loader_for(model.model)
    _resolve_parallel(config, loader)
    explicit_diffusion = config.diffusion is not None  # issue 15 (additive)
    loader.resolve_limits(config)
    check_diffusion(config, loader, explicit_diffusion)
    if model.max_model_len is None:
        raise ConfigError("model.max_model_len: could not be determined; set it explicitly")
    if config.cache.num_kv_blocks is None:
        per_seq = math.ceil(model.max_model_len / config.cache.block_size)
        config.cache.num_kv_blocks = config.scheduler.max_num_seqs * per_seq
    capacity = config.cache.num_kv_blocks * config.cache.block_size
    if capacity < model.max_model_len:
        raise ConfigError(
            f"cache.num_kv_blocks: {config.cache.num_kv_blocks} blocks of "
            f"{config.cache.block_size} tokens hold {capacity} tokens, fewer than "
            f"max_model_len ({model.max_model_len}); one request could never finish"
        )
    spec = config.speculative
    if spec and spec.prompt_lookup_min > spec.prompt_lookup_max:
        raise ConfigError("speculative.prompt_lookup_min must be <= speculative.prompt_lookup_max")
    config.scheduler.async_scheduling = _resolve_async(config, executor_supports_async)
    resolve_worker_threads(config)
    if config._stack is None:
        keep_stack(config, resolve_stack(config))
    check_diffusion_stack(config, config._stack)  # issue 15 (additive)
    config.attached_plugins = [
        class_path(cls)
        for cls in loadable_plugins().values()
        if (flag := capability(cls, "attached_by")) and getattr(config, flag, False)
    ]
    return config


# kv-multi finds and checks its children as this resolver does (plugins may not import it)
kv_multi_children.resolver = kv_multi_children.ChildResolver(load_plugin_class, check_signatures)
