"""What a plugin is, and a pluggy manager holding one side of a resolved stack.

Plugins are found by name on the front door (`tandem.plugin_discovery`) and the stack is
resolved there once (`tandem.config_resolution.resolve_config`: names to classes, implied
plugins, options, conflicts), kept on the config with its serialisable form in
`config.resolved_stack` (each class as `module:Class`). The kernel never discovers plugins:
`stack_of` returns the kept `ResolvedStack`, or rebuilds it in another process by importing
each class by path; the engine and the worker each build a `TandemPluginManager` from that
one stack. Stack order is call order, so plugins are registered in reverse (pluggy calls
the most recently registered implementation first). A plugin declares what it is with class
attributes read from the class, no instance (`CAPABILITIES`, documented on `TandemPlugin`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import CodeType
from typing import Any, ClassVar

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.core.clock import WALL_CLOCK, Clock
from tandem.core.hookspecs import PROJECT, EngineHookSpecs, WorkerHookSpecs
from tandem.core.plugin_error import HookSite, PluginError, definition_site, failing_hook
from tandem.schema.config import ConfigError, EngineConfig, PluginSpec
from tandem.schema.sampling_params import format_validation_error

ENTRY_POINT_GROUP = "tandem.plugins"
ENGINE_HOOKS = frozenset(n for n in dir(EngineHookSpecs) if not n.startswith("_"))
WORKER_HOOKS = frozenset(n for n in dir(WorkerHookSpecs) if not n.startswith("_"))
ALL_HOOKS = ENGINE_HOOKS | WORKER_HOOKS


class PluginConfigError(ConfigError):
    """A stack that cannot run: unknown plugin, bad options, conflicting plugins."""


class PluginStartError(PluginError, PluginConfigError):
    """A plugin's hook raised while the stack started (`tandem_stack_loaded`, and the
    hooks the scheduler asks then: `make_waiting_queue`): a `PluginError` naming the
    plugin and the hook, and a `PluginConfigError` (the stack cannot run)."""


class NoOptions(BaseModel):
    """The options model of a plugin that takes none: any key is an error."""

    model_config = ConfigDict(extra="forbid")


class TandemPlugin:
    """Convenience base class for plugins (not required: any class with the same
    constructor and class attributes works). `Options` is the plugin's pydantic options
    model. The other class attributes are capabilities, read from the class (`capability`
    gives these defaults to a class that declares nothing)."""

    Options: ClassVar[type[BaseModel]] = NoOptions
    #: "scheduler", "async-layer", "sampler", "drafter" or "grammar": the resolver places
    #: and counts plugins by role (one scheduler, at most one drafter, ...).
    role: ClassVar[str | None] = None
    #: Fills its role in a stack that names none (the default stack's scheduler and
    #: sampler, the async layer implied by async scheduling); one installed plugin per role.
    default_for_role: ClassVar[bool] = False
    #: drafter: the `speculative.method` values it answers (a default stack takes the
    #: installed drafter declaring the configured method).
    speculative_methods: ClassVar[tuple[str, ...]] = ()
    #: drafter: its drafts continue the sampled tokens (async scheduling can keep them).
    aligned_drafts: ClassVar[bool] = True
    #: drafter: reads the target model's hidden states (the runner keeps them).
    needs_hidden_states: ClassVar[bool] = False
    #: grammar: the `structured_output.backend` values it answers.
    grammar_backends: ClassVar[tuple[str, ...]] = ()
    #: grammar: needs the model's tokenizer (the model's loader says if there is one).
    needs_tokenizer: ClassVar[bool] = False
    #: sampler: applies the grammar bitmask (`grammar_bitmask`'s answer) when sampling.
    applies_grammar_bitmask: ClassVar[bool] = False
    #: cross-cutting (tracing, invariant checks): the config flag that attaches it to every
    #: engine; its class method `attach(engine)` registers it on the engine's manager.
    attached_by: ClassVar[str | None] = None
    #: The engine's clock (`core/clock.py`), set by the plugin manager after construction.
    clock: Clock = WALL_CLOCK

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        self.config = config
        self.options = options


#: The capabilities a plugin class may declare (class attributes of `TandemPlugin`).
CAPABILITIES = tuple(name for name in TandemPlugin.__annotations__ if name != "Options")


def capability(cls: type, name: str) -> Any:
    """The capability `name` that `cls` declares, else `TandemPlugin`'s default."""
    return getattr(cls, name, getattr(TandemPlugin, name))


def import_class(path: str) -> Any:
    """The object at `module:Qualname` (AttributeError / ImportError when absent)."""
    module, _, qualname = path.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def implemented_hooks(cls: type) -> set[str]:
    """Names of hooks a plugin class implements (methods marked with `hookimpl`)."""
    return {
        attr
        for attr, value in inspect.getmembers(cls)
        if callable(value) and hasattr(value, PROJECT + "_impl")
    }


def plugin_sides(cls: type) -> set[str]:
    hooks = implemented_hooks(cls)
    return {
        side
        for side, names in (("engine", ENGINE_HOOKS), ("worker", WORKER_HOOKS))
        if hooks & names
    }


# The resolved stack -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StackEntry:
    """One plugin of a resolved stack: its class, validated options, and where the stack
    names it (`file:line: plugins[i]`, for errors)."""

    name: str
    cls: type
    options: BaseModel
    raw_options: dict
    where: str

    def cap(self, name: str) -> object:
        return capability(self.cls, name)


@dataclass(frozen=True, slots=True)
class ResolvedStack:
    """The stack in call order, with the facts the kernel derives from it."""

    entries: tuple[StackEntry, ...]

    def with_role(self, role: str) -> list[StackEntry]:
        return [e for e in self.entries if e.cap("role") == role]

    @property
    def drafter(self) -> StackEntry | None:
        return next(iter(self.with_role("drafter")), None)

    @property
    def needs_hidden_states(self) -> bool:
        return any(e.cap("needs_hidden_states") for e in self.with_role("drafter"))

    @property
    def applies_grammar_bitmask(self) -> bool:
        return any(e.cap("applies_grammar_bitmask") for e in self.with_role("sampler"))


def stack_entry(cls: type, spec: PluginSpec, where: str) -> StackEntry:
    """`cls` as the stack entry `spec` names: it implements only known hooks and its
    options validate against its `Options` model (errors name `where`). Resolution also
    checks each hook implementation's signature (`tandem.stack_checks`)."""
    unknown = implemented_hooks(cls) - ALL_HOOKS
    if unknown:
        raise PluginConfigError(
            f"plugin {spec.name!r} implements unknown hook(s) {sorted(unknown)}; "
            f"known hooks: {sorted(ALL_HOOKS)}"
        )
    try:
        options = getattr(cls, "Options", NoOptions).model_validate(spec.options)
    except ValidationError as exc:
        raise PluginConfigError(format_validation_error(exc, f"{where}.options")) from exc
    return StackEntry(spec.name, cls, options, dict(spec.options), where)


def stack_of(config: EngineConfig) -> ResolvedStack:
    """The config's resolved stack: the one kept on it, or rebuilt from
    `config.resolved_stack` by importing each class by path (a worker in another
    process). A config that was never resolved is an error: resolve it first."""
    if config._stack is not None:
        return config._stack
    if config.resolved_stack is None:
        raise ConfigError("the plugin stack is not resolved: call resolve_config first")
    entries = []
    for spec in config.resolved_stack:
        where = f"plugin {spec.name!r}"
        if isinstance(spec.plugin, type):
            cls = spec.plugin
        else:
            try:
                cls = import_class(spec.plugin if isinstance(spec.plugin, str) else spec.name)
            except (ImportError, AttributeError) as exc:
                raise PluginConfigError(f"{where}: cannot import {spec.plugin!r}: {exc}") from exc
        entries.append(stack_entry(cls, spec, where))
    config._stack = ResolvedStack(tuple(entries))
    return config._stack


# The manager ----------------------------------------------------------------------------


class TandemPluginManager(pluggy.PluginManager):
    """A pluggy manager holding one side (engine or worker) of the config's resolved stack
    (`stack_of`: resolved once on the front door, shared by both sides)."""

    def __init__(
        self,
        config: EngineConfig,
        side: str = "engine",
        source: str = "<config>",
        clock: Clock = WALL_CLOCK,
    ) -> None:

        super().__init__(PROJECT)
        self.config = config
        self.side = side
        self.add_hookspecs(EngineHookSpecs)
        self.add_hookspecs(WorkerHookSpecs)
        self.resolved = stack_of(config)
        self.stack_names = [entry.name for entry in self.resolved.entries]
        instances: list[tuple[str, Any]] = []
        for i, entry in enumerate(self.resolved.entries):
            if side not in plugin_sides(entry.cls):
                continue
            try:
                instance = entry.cls(config, entry.options)
                instance.clock = clock  # the engine's clock, set before the stack starts
            except PluginConfigError:
                raise
            except Exception as exc:
                raise PluginConfigError(
                    f"{entry.where}: plugin {entry.name!r} failed to start: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            # A plugin may appear twice in a stack (with different options).
            name = entry.name if entry.name not in dict(instances) else f"{entry.name}#{i}"
            instances.append((name, instance))
        for name, instance in reversed(instances):
            try:
                self.register(instance, name=name)
            except pluggy.PluginValidationError as exc:
                raise PluginConfigError(f"{source}: plugin {name!r}: {exc}") from exc
        try:
            self.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginConfigError(f"{source}: {exc}") from exc
        self.stack = instances
        try:
            self.hook.tandem_stack_loaded(manager=self)
        except PluginConfigError:
            raise
        except Exception as exc:
            failure = self.plugin_error(exc, "the stack's start", error=PluginStartError)
            if failure is None:
                raise
            raise failure from exc

    def hook_sites(self) -> dict[CodeType, list[HookSite]]:
        """Every hook implementation this manager may run, by code object: those
        registered here, then the stack's implementations of the other side (a worker
        in this process runs them). For `plugin_error`; built when asked."""
        sites: dict[CodeType, list[HookSite]] = {}
        for caller in vars(self.hook).values():
            for impl in caller.get_hookimpls():
                function = getattr(impl.function, "__func__", impl.function)
                code = getattr(function, "__code__", None)
                if code is not None:
                    wrapper = bool(impl.wrapper or impl.hookwrapper)
                    where = definition_site(function)
                    site = HookSite(impl.plugin_name, caller.name, impl.plugin, wrapper, where)
                    sites.setdefault(code, []).append(site)
        for entry in self.resolved.entries:
            for hook in implemented_hooks(entry.cls):
                function = getattr(entry.cls, hook)
                code = getattr(function, "__code__", None)
                if code is not None and code not in sites:
                    where = definition_site(function)
                    sites[code] = [HookSite(entry.name, hook, None, False, where)]
        return sites

    def plugin_error(
        self,
        exc: BaseException,
        phase: str,
        step: int | None = None,
        error: type[PluginError] = PluginError,
    ) -> PluginError | None:
        """`exc` as an `error` naming the plugin and hook that raised it (`failing_hook`)
        and `phase` (when: `engine step 3`), or None when no hook implementation raised
        it (the caller reports `exc` as it is)."""
        if isinstance(exc, PluginError):
            return exc
        site = getattr(exc, "hook_site", None)  # named where it ran (a worker process)
        if not isinstance(site, HookSite):
            site = failing_hook(exc, self.hook_sites())
        if site is None:
            return None
        failure = error(site.plugin, site.hook, site.where, phase, exc, step)
        failure.__cause__ = exc
        return failure

    def plugins_with_role(self, role: str) -> list[Any]:
        return [p for _, p in self.stack if capability(type(p), "role") == role]

    def plugin_names(self) -> list[str]:
        """The whole resolved stack, in call order (both sides)."""
        return list(self.stack_names)
