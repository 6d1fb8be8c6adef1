"""The children of `kv-multi`: how each is named (`ConnectorSpec`, both the stack form and
vLLM's), built with its validated options (`build_child`), and called directly with the
arguments its hook implementations take (`Child.call`)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.core.entry_points import plugin_entry_points
from tandem.core.hookspecs import PROJECT
from tandem.core.plugin_manager import (
    PluginConfigError,
    capability,
    implemented_hooks,
    import_class,
    stack_entry,
)
from tandem.kv.connector import (
    KV_CONNECTOR_ALIASES,
    KVConnectorSchedulerSpecs,
    KVConnectorWorkerSpecs,
)
from tandem.schema.config import ConfigError, EngineConfig, PluginSpec, class_path

logger = logging.getLogger("tandem.kv_multi")

#: The hooks a child connector answers (the KV-connector hookspecs, both sides).
CONNECTOR_HOOKS = frozenset(
    name
    for specs in (KVConnectorSchedulerSpecs, KVConnectorWorkerSpecs)
    for name in vars(specs)
    if not name.startswith("_")
)


class ConnectorSpec(BaseModel):
    """One child connector: `{name, options}` or vLLM's `{kv_connector, kv_role,
    kv_connector_extra_config}` (a bare name, or a class, stands for `{name}`)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, description="a connector plugin's name or module:Class")
    options: dict[str, Any] | None = Field(None, description="the child's options")
    kv_connector: str | None = Field(None, description="vLLM's form of `name`")
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] | None = None
    kv_connector_extra_config: dict[str, Any] | None = Field(
        None, description="vLLM's form of `options`"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, data: Any) -> Any:
        """A bare name or class is `{name}`; a class as `name` becomes its import path."""
        if isinstance(data, str | type):
            data = {"name": data}
        if isinstance(data, dict) and isinstance(data.get("name"), type):
            data = {**data, "name": class_path(data["name"])}
        return data

    @model_validator(mode="after")
    def _one_form(self) -> ConnectorSpec:
        if (self.name is None) == (self.kv_connector is None):
            raise ValueError("give either name (and options) or kv_connector")
        if self.name is not None and (self.kv_role or self.kv_connector_extra_config):
            raise ValueError("kv_role and kv_connector_extra_config go with kv_connector")
        if self.kv_connector is not None and self.options is not None:
            raise ValueError("with kv_connector the options are kv_connector_extra_config")
        return self

    def plugin_name(self) -> str:
        """The child's plugin name, vLLM's class names translated (`KV_CONNECTOR_ALIASES`)."""
        name = self.name if self.name is not None else self.kv_connector
        assert name is not None
        return KV_CONNECTOR_ALIASES.get(name, name)

    def plugin_options(self) -> dict[str, Any]:
        """The child's options (`options` or `kv_connector_extra_config`), unvalidated."""
        return dict(self.options or self.kv_connector_extra_config or {})


@dataclass(slots=True)
class Child:
    """A child connector: its instance and its KV-connector hook implementations, each with
    the argument names it takes (a hook implementation may take a subset, as in pluggy)."""

    name: str
    instance: Any
    hooks: dict[str, tuple[Callable[..., Any], tuple[str, ...]]]

    def call(self, hook: str, **kwargs: Any) -> Any:
        """The child's answer to `hook`, or None where it does not implement it."""
        impl = self.hooks.get(hook)
        if impl is None:
            return None
        function, argnames = impl
        return function(**{n: kwargs[n] for n in argnames if n in kwargs})


def _load_class(name: str, where: str) -> type:
    """A plugin class by entry-point name or `module:Class` (the front door's resolver, which
    also knows names registered in-process, replaces this: `ChildResolver`)."""
    for entry_point in plugin_entry_points():
        if entry_point.name == name:
            return entry_point.load()
    if ":" in name:
        return import_class(name)
    raise PluginConfigError(f"{where}: no plugin named {name!r}")


@dataclass(slots=True)
class ChildResolver:
    """How children are found and checked. Plugins sit below the front door and may not
    import it, so `tandem.config_resolution` installs its own plugin lookup and signature
    check here (`resolver`); without it, entry points and `module:Class` paths only."""

    load_class: Callable[[str, str], type] = _load_class
    check_signatures: Callable[[type, PluginSpec, str], None] = lambda cls, spec, where: None


resolver = ChildResolver()


def build_child(config: EngineConfig, spec: ConnectorSpec, where: str) -> Child:
    """Child `where` built from `spec`: a KV-connector plugin other than kv-multi, its
    options validated by its `Options` model and its hook signatures checked as the
    resolver checks a stack's plugins; errors are `PluginConfigError`s naming `where`."""
    name = spec.plugin_name()
    cls = resolver.load_class(name, f"{where}.name")
    if getattr(cls, "contains_connectors", False):
        raise PluginConfigError(f"{where}.name: {name!r}: kv-multi cannot contain itself")
    if capability(cls, "role") != "kv-connector":
        raise PluginConfigError(
            f"{where}.name: {name!r} is not a KV connector plugin (role kv-connector)"
        )
    plugin_spec = PluginSpec(name=name, options=spec.plugin_options())
    entry = stack_entry(cls, plugin_spec, where)
    resolver.check_signatures(cls, plugin_spec, where)
    try:
        instance = cls(config, entry.options)
    except ConfigError:
        raise
    except Exception as exc:
        raise PluginConfigError(
            f"{where}: plugin {name!r} failed to start: {type(exc).__name__}: {exc}"
        ) from exc
    return Child(name, instance, _child_hooks(instance, name, where))


def _child_hooks(
    instance: Any, name: str, where: str
) -> dict[str, tuple[Callable[..., Any], tuple[str, ...]]]:
    """The child's KV-connector hook implementations with their argument names; a wrapper
    implementation is refused (it cannot be called directly)."""
    hooks = {}
    implemented = implemented_hooks(type(instance))
    for hook in sorted(implemented & CONNECTOR_HOOKS):
        function = getattr(instance, hook)
        opts = getattr(function, PROJECT + "_impl", None) or {}
        if opts.get("wrapper") or opts.get("hookwrapper"):
            raise PluginConfigError(
                f"{where}: plugin {name!r}: {hook} is a wrapper hook implementation; a "
                "kv-multi child answers its hooks directly"
            )
        hooks[hook] = (function, tuple(inspect.signature(function).parameters))
    ignored = sorted(implemented - CONNECTOR_HOOKS)
    if ignored:
        logger.warning(
            "%s: plugin %r also implements %s; kv-multi calls only a child's KV-connector hooks",
            where,
            name,
            ", ".join(ignored),
        )
    return hooks
