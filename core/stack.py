"""The resolved plugin stack: what the kernel's plugin managers are built from.

The front door resolves a stack once (`tandem.config_resolution.resolve_config`: names to
classes, implied plugins, options, conflicts) and keeps it on the config, with its
serialisable form in `config.resolved_stack` (each class as `module:Class`). The kernel
never discovers plugins: `stack_of` returns the kept stack, or rebuilds it in another
process by importing each class by path.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from tandem.config import ConfigError, EngineConfig, PluginSpec
from tandem.core.plugin_manager import (
    ALL_HOOKS,
    NoOptions,
    PluginConfigError,
    capability,
    implemented_hooks,
    import_class,
)
from tandem.sampling_params import format_validation_error


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

    def spec(self) -> PluginSpec:
        return PluginSpec(name=self.name, options=self.raw_options, plugin=self.cls)


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
    options validate against its `Options` model (errors name `where`)."""
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


def keep_stack(config: EngineConfig, stack: ResolvedStack) -> ResolvedStack:
    """Keep `stack` on `config`, with its serialisable form in `config.resolved_stack`."""
    config._stack = stack
    config.resolved_stack = [e.spec() for e in stack.entries]
    return stack


def stack_of(config: EngineConfig) -> ResolvedStack:
    """The config's resolved stack: the one kept on it, or rebuilt from
    `config.resolved_stack` by importing each class by path (a worker in another
    process). A config that was never resolved is an error: resolve it first."""
    if config._stack is not None:
        return config._stack
    if config.resolved_stack is None:
        raise ConfigError(
            "the config's plugin stack is not resolved; pass it through "
            "tandem.config_resolution.resolve_config first"
        )
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
