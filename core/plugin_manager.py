"""Loading a plugin stack: discovery by entry point, option validation, registration order.

Bundled plugins are found exactly like third-party ones: through the entry-point group
`tandem.plugins` (tandem's own distribution declares its bundled plugins there). A plugin
is inactive until a stack names it. Stack order is call order, so plugins are registered in
reverse (pluggy calls the most recently registered implementation first).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.core.config import ConfigError, EngineConfig, PluginSpec, with_line
from tandem.core.hookspecs import PROJECT, EngineHookSpecs, WorkerHookSpecs
from tandem.sampling_params import format_validation_error

logger = logging.getLogger("tandem.plugins")

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
    constructor and class attributes works).

    `role` lets the stack resolver find conflicts (two schedulers) and place the async
    layer right after the scheduler. `Options` is the plugin's pydantic options model.
    """

    role: ClassVar[str | None] = None
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        self.config = config
        self.options = options


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What discovery knows about one installed plugin, without instantiating it."""

    name: str
    value: str
    distribution: str
    version: str


_scan: tuple[tuple[tuple[str, int, int], ...], tuple[metadata.EntryPoint, ...]] | None = None


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


def plugin_entry_points() -> tuple[metadata.EntryPoint, ...]:
    """The entry points of the group `tandem.plugins`. Scanning every installed
    distribution is slow (resolving one stack asks many times), so the scan is kept until
    `sys.path` or one of its directories changes."""
    global _scan
    state = _path_state()
    if _scan is None or _scan[0] != state:
        _scan = (state, tuple(metadata.entry_points(group=ENTRY_POINT_GROUP)))
    return _scan[1]


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


def load_plugin_class(name: str, where: str = "plugins") -> type:
    """Import the plugin class behind entry point `name`; errors name the plugin and cause.

    Anything a plugin raises while importing, `SystemExit` included (a plugin module that
    calls `sys.exit`), becomes a `PluginConfigError`: one broken plugin must not end the
    process that merely looked at it. Only `KeyboardInterrupt` passes through."""
    for ep in (ep for ep in plugin_entry_points() if ep.name == name):
        try:
            return ep.load()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # reported, never swallowed, never fatal
            cause = (
                f"called sys.exit({exc.code!r}) while importing"
                if isinstance(exc, SystemExit)
                else f"{type(exc).__name__}: {exc}"
            )
            raise PluginConfigError(
                f"{where}: plugin {name!r} ({ep.value}) failed to import: {cause}"
            ) from exc
    available = ", ".join(sorted(discover_plugins())) or "none"
    raise PluginConfigError(
        f"{where}: unknown plugin {name!r}; installed plugins: {available} "
        f"(entry-point group {ENTRY_POINT_GROUP!r})"
    )


def implemented_hooks(cls: type) -> set[str]:
    """Names of hooks a plugin class implements (methods marked with `hookimpl`)."""
    hooks = set()
    for attr, value in inspect.getmembers(cls):
        if callable(value) and hasattr(value, PROJECT + "_impl"):
            hooks.add(attr)
    return hooks


def plugin_sides(cls: type) -> set[str]:
    hooks = implemented_hooks(cls)
    sides = set()
    if hooks & ENGINE_HOOKS:
        sides.add("engine")
    if hooks & WORKER_HOOKS:
        sides.add("worker")
    return sides


#: The drafter plugin the default stack adds for each `speculative.method`.
DRAFTER_FOR_METHOD = {
    "ngram": "ngram-drafter",
    "eagle": "eagle-drafter",
    "draft_model": "draft-model-drafter",
    "scripted": "scripted-drafter",
}


def default_stack(config: EngineConfig) -> list[PluginSpec]:
    """The stack used when the config names none: the reference scheduler and sampler,
    the `structured-output` grammar plugin for a real model (one with a tokenizer), and
    the drafter of `speculative.method` when speculative decoding is configured."""
    stack = [PluginSpec(name="reference-scheduler"), PluginSpec(name="default-sampler")]
    if config.model.model != "scripted":  # a real model has a tokenizer: grammars work
        stack.append(PluginSpec(name="structured-output"))
    if config.speculative is not None:
        stack.append(PluginSpec(name=DRAFTER_FOR_METHOD[config.speculative.method]))
    return stack


def find_drafter(config: EngineConfig, source: str = "<config>") -> tuple[str, type] | None:
    """(name, class) of the drafter-role plugin the stack will use, or None.

    Raises `PluginConfigError` when the stack and `speculative` disagree: speculative
    decoding configured but no drafter in an explicit stack, or a drafter without it."""
    specs = list(config.plugins) if config.plugins is not None else default_stack(config)
    drafters = []
    for i, spec in enumerate(specs):
        where = f"{with_line(source, config._lines, ('plugins', i))}: plugins[{i}].name"
        cls = load_plugin_class(spec.name, where)
        if getattr(cls, "role", None) == "drafter":
            drafters.append((spec.name, cls))
    if config.speculative is not None and not drafters:
        raise PluginConfigError(
            f"{source}: speculative: method {config.speculative.method!r} is configured but "
            f"the stack ({', '.join(s.name for s in specs)}) has no drafter plugin; add "
            f"{DRAFTER_FOR_METHOD[config.speculative.method]!r} to plugins"
        )
    if config.speculative is None and drafters:
        raise PluginConfigError(
            f"{source}: plugins: the drafter {drafters[0][0]!r} needs a speculative section "
            "(speculative: {method: ..., num_speculative_tokens: k}), but none is configured"
        )
    if len(drafters) > 1:
        raise PluginConfigError(
            f"{source}: plugins: {len(drafters)} plugins claim the drafter role "
            f"({', '.join(n for n, _ in drafters)}); a stack has at most one drafter"
        )
    return drafters[0] if drafters else None


def resolve_stack(config: EngineConfig, source: str = "<config>") -> list[tuple[PluginSpec, type]]:
    """Resolve names to classes, add implied plugins, reject conflicts.

    The async layer (`async-scheduler`) is inserted right after the scheduler when
    `scheduler.async_scheduling` is true and the stack does not name an async layer.
    """
    specs = list(config.plugins) if config.plugins is not None else default_stack(config)
    resolved = [
        (
            spec,
            load_plugin_class(
                spec.name,
                f"{with_line(source, config._lines, ('plugins', i))}: plugins[{i}].name",
            ),
        )
        for i, spec in enumerate(specs)
    ]
    roles: dict[str, list[str]] = {}
    for spec, cls in resolved:
        role = getattr(cls, "role", None)
        if role:
            roles.setdefault(role, []).append(spec.name)
    for role in ("scheduler", "async-layer", "sampler"):
        if len(roles.get(role, [])) > 1:
            raise PluginConfigError(
                f"{source}: plugins: {len(roles[role])} plugins claim the {role} role "
                f"({', '.join(roles[role])}); a stack has exactly one {role}"
            )
    if "scheduler" not in roles:
        raise PluginConfigError(f"{source}: plugins: the stack has no scheduler plugin")
    find_drafter(config, source)
    if "grammar" in roles:
        masking = [
            spec.name
            for spec, cls in resolved
            if getattr(cls, "role", None) == "sampler"
            and getattr(cls, "applies_grammar_bitmask", False)
        ]
        if not masking:
            samplers = roles.get("sampler", [])
            raise PluginConfigError(
                f"{source}: plugins: the grammar backend {roles['grammar'][0]} needs a sampler "
                "that applies grammar bitmasks (`applies_grammar_bitmask = True`), but "
                + (f"{samplers[0]} does not" if samplers else "the stack has no sampler")
            )
    if config.scheduler.async_scheduling and "async-layer" not in roles:
        index = next(
            i for i, (_, c) in enumerate(resolved) if getattr(c, "role", None) == "scheduler"
        )
        spec = PluginSpec(name="async-scheduler")
        resolved.insert(index + 1, (spec, load_plugin_class(spec.name, f"{source}: plugins")))
    if not config.scheduler.async_scheduling and "async-layer" in roles:
        raise PluginConfigError(
            f"{source}: plugins: {roles['async-layer'][0]} needs scheduler.async_scheduling: true"
        )
    return resolved


def stack_entry_location(config: EngineConfig, spec: PluginSpec, source: str) -> str:
    """`file:N: plugins[i]` for a plugin the stack file names; a plugin the resolver
    added (the async layer) has no entry and is named instead."""
    for i, named in enumerate(config.plugins or []):
        if named is spec:
            return f"{with_line(source, config._lines, ('plugins', i))}: plugins[{i}]"
    return f"{source}: plugin {spec.name!r} (implied by the stack)"


def validate_options(spec: PluginSpec, cls: type, where: str) -> BaseModel:
    options_model: type[BaseModel] = getattr(cls, "Options", NoOptions)
    try:
        return options_model.model_validate(spec.options)
    except ValidationError as exc:
        raise PluginConfigError(format_validation_error(exc, f"{where}.options")) from exc


class TandemPluginManager(pluggy.PluginManager):
    """A pluggy manager holding one side (engine or worker) of a resolved stack."""

    def __init__(
        self, config: EngineConfig, side: str = "engine", source: str = "<config>"
    ) -> None:
        super().__init__(PROJECT)
        self.config = config
        self.side = side
        self.add_hookspecs(EngineHookSpecs)
        self.add_hookspecs(WorkerHookSpecs)
        self.stack: list[tuple[str, Any]] = []
        resolved = resolve_stack(config, source)
        instances: list[tuple[str, Any]] = []
        self.stack_names = [spec.name for spec, _ in resolved]
        for i, (spec, cls) in enumerate(resolved):
            where = stack_entry_location(config, spec, source)
            options = validate_options(spec, cls, where)
            self._check_hook_names(spec.name, cls)
            if side not in plugin_sides(cls):
                continue
            try:
                instance = cls(config, options)
            except PluginConfigError:
                raise
            except Exception as exc:
                raise PluginConfigError(
                    f"{where}: plugin {spec.name!r} failed to start: {type(exc).__name__}: {exc}"
                ) from exc
            # A plugin may appear twice in a stack (with different options).
            name = spec.name if spec.name not in dict(instances) else f"{spec.name}#{i}"
            instances.append((name, instance))
        if not any("sample" in implemented_hooks(cls) for _, cls in resolved):
            # After every plugin's options were checked: those errors are more specific.
            raise PluginConfigError(
                f"{source}: plugins: the stack has no sampler (no plugin implements "
                "`sample`); add 'default-sampler'"
            )
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

    @staticmethod
    def _check_hook_names(name: str, cls: type) -> None:
        unknown = implemented_hooks(cls) - ALL_HOOKS
        if unknown:
            raise PluginConfigError(
                f"plugin {name!r} implements unknown hook(s) {sorted(unknown)}; "
                f"known hooks: {sorted(ALL_HOOKS)}"
            )

    def plugins_with_role(self, role: str) -> list[Any]:
        return [p for _, p in self.stack if getattr(p, "role", None) == role]

    def plugin_names(self) -> list[str]:
        """The whole resolved stack, in call order (both sides)."""
        return list(self.stack_names)
