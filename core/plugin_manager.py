"""Finding plugins and holding one side of a resolved stack.

A plugin is found by name: an entry point of the group `tandem.plugins` (tandem's own
distribution declares its bundled plugins there, exactly like a third-party one), then a
name registered in this process (`register_plugin`: the test kit's doubles, classes under
test), then an import path `module:Class`. A stack may also hold the class itself
(`LLM(plugins=[MyScheduler])`). A plugin is inactive until a stack names it.

A plugin declares what it is with class attributes read from the class, no instance
(`CAPABILITIES`; `TandemPlugin` documents each and its default). The stack is resolved once
(`tandem.core.resolve.stack_of`); the engine and the worker each build a
`TandemPluginManager` from that one `ResolvedStack`. Stack order is call order, so plugins
are registered in reverse (pluggy calls the most recently registered implementation first).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

import pluggy
from pydantic import BaseModel, ConfigDict

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.hookspecs import PROJECT, EngineHookSpecs, WorkerHookSpecs

ENTRY_POINT_GROUP = "tandem.plugins"
ENGINE_HOOKS = frozenset(n for n in vars(EngineHookSpecs) if not n.startswith("_"))
WORKER_HOOKS = frozenset(n for n in vars(WorkerHookSpecs) if not n.startswith("_"))
ALL_HOOKS = ENGINE_HOOKS | WORKER_HOOKS


class PluginConfigError(ConfigError):
    """A stack that cannot run: unknown plugin, bad options, conflicting plugins."""


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

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        self.config = config
        self.options = options


#: The capabilities a plugin class may declare (class attributes of `TandemPlugin`).
CAPABILITIES = tuple(name for name in TandemPlugin.__annotations__ if name != "Options")


def capability(cls: type, name: str) -> Any:
    """The capability `name` that `cls` declares, else `TandemPlugin`'s default."""
    return getattr(cls, name, getattr(TandemPlugin, name))


# Discovery ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What discovery knows about one installed plugin, without importing it."""

    name: str
    value: str
    distribution: str
    version: str


_scans: dict[str, tuple[tuple[tuple[str, int, int], ...], tuple[metadata.EntryPoint, ...]]] = {}


def _path_state() -> tuple[tuple[str, int, int], ...]:
    """`sys.path` with each directory's mtime and link count: installing or removing a
    distribution adds or removes a directory entry, which changes both (the link count
    even within one tick of the file system's clock)."""
    state = []
    for entry in sys.path:
        try:
            st = os.stat(entry or ".")
            state.append((entry, st.st_mtime_ns, st.st_nlink))
        except OSError:
            state.append((entry, -1, -1))
    return tuple(state)


def plugin_entry_points(group: str = ENTRY_POINT_GROUP) -> tuple[metadata.EntryPoint, ...]:
    """The entry points of `group`. Scanning every installed distribution is slow, so the
    scan is kept until `sys.path` or one of its directories changes."""
    state = _path_state()
    scan = _scans.get(group)
    if scan is None or scan[0] != state:
        scan = _scans[group] = (state, tuple(metadata.entry_points(group=group)))
    return scan[1]


def discover_plugins() -> dict[str, PluginInfo]:
    """Every plugin installed under the entry-point group, by name (not imported)."""
    found: dict[str, PluginInfo] = {}
    for ep in plugin_entry_points():
        dist = getattr(ep, "dist", None)
        found[ep.name] = PluginInfo(
            name=ep.name,
            value=ep.value,
            distribution=dist.metadata["Name"] if dist is not None else "?",
            version=dist.version if dist is not None else "?",
        )
    return found


#: Plugins registered by class in this process (`register_plugin`), by name.
_registered: dict[str, type] = {}


def register_plugin(name: str, cls: type) -> None:
    """Make `cls` resolvable as `name` in this process (after the installed plugins of
    that name). A worker in another process gets the class by its import path."""
    _registered[name] = cls


def unregister_plugin(name: str) -> None:
    _registered.pop(name, None)


def import_class(path: str) -> Any:
    """The object at `module:Qualname` (AttributeError / ImportError when absent)."""
    module, _, qualname = path.partition(":")
    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def load_plugin_class(name: str, where: str = "plugins") -> type:
    """The plugin class behind `name` (entry point, registered name, or `module:Class`).

    Anything a plugin raises while importing, `SystemExit` included (a plugin module that
    calls `sys.exit`), becomes a `PluginConfigError` naming the plugin and the cause: one
    broken plugin must not end the process that merely looked at it. Only
    `KeyboardInterrupt` passes through."""
    found = [(ep.value, ep.load) for ep in plugin_entry_points() if ep.name == name]
    if not found and name in _registered:
        return _registered[name]
    if not found and ":" in name:
        found = [(name, lambda: import_class(name))]
    for value, load in found:
        try:
            return load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # reported, never swallowed, never fatal
            cause = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, SystemExit):
                cause = f"called sys.exit({exc.code!r}) while importing"
            raise PluginConfigError(
                f"{where}: plugin {name!r} ({value}) failed to import: {cause}"
            ) from exc
    available = ", ".join(sorted({*discover_plugins(), *_registered})) or "none"
    raise PluginConfigError(
        f"{where}: unknown plugin {name!r}; installed plugins: {available} "
        f"(entry-point group {ENTRY_POINT_GROUP!r}; or name a class as module:Class)"
    )


_loadable: tuple[tuple[Any, ...], dict[str, type]] | None = None


def loadable_plugins() -> dict[str, type]:
    """Every installed and registered plugin that imports, by name (broken ones skipped):
    what the resolver reads declared names from. Kept until discovery or the registry
    changes."""
    global _loadable
    key = (plugin_entry_points(), tuple(_registered.items()))
    if _loadable is None or _loadable[0] != key:
        classes = dict(_registered)
        for ep in key[0]:
            try:
                classes[ep.name] = load_plugin_class(ep.name)
            except PluginConfigError:
                continue
        _loadable = (key, classes)
    return _loadable[1]


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


# The manager ----------------------------------------------------------------------------


class TandemPluginManager(pluggy.PluginManager):
    """A pluggy manager holding one side (engine or worker) of the config's resolved stack
    (`resolve.stack_of`: resolved once, shared by both sides)."""

    def __init__(
        self, config: EngineConfig, side: str = "engine", source: str = "<config>"
    ) -> None:
        from tandem.core.resolve import stack_of  # resolve imports this module

        super().__init__(PROJECT)
        self.config = config
        self.side = side
        self.add_hookspecs(EngineHookSpecs)
        self.add_hookspecs(WorkerHookSpecs)
        self.resolved = stack_of(config, source)
        self.stack_names = [entry.name for entry in self.resolved.entries]
        instances: list[tuple[str, Any]] = []
        for i, entry in enumerate(self.resolved.entries):
            if side not in plugin_sides(entry.cls):
                continue
            try:
                instance = entry.cls(config, entry.options)
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
        self.hook.tandem_stack_loaded(manager=self)

    def plugins_with_role(self, role: str) -> list[Any]:
        return [p for _, p in self.stack if capability(type(p), "role") == role]

    def plugin_names(self) -> list[str]:
        """The whole resolved stack, in call order (both sides)."""
        return list(self.stack_names)
