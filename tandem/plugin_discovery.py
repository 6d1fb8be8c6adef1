"""Finding installed plugins by name, without the kernel.

A plugin is found by name: an entry point of the group `tandem.plugins` (tandem's own
distribution declares its bundled plugins there, exactly like a third-party one), then a
name registered in this process (`register_plugin`: the test kit's doubles, classes under
test), then an import path `module:Class`. A plugin is inactive until a stack names it.
Discovery serves the front door (resolving a stack, `tandem plugins list`); the kernel
only ever sees the resolved stack's classes (`tandem.core.plugin_manager`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.core.entry_points import plugin_entry_points
from tandem.core.plugin_manager import ENTRY_POINT_GROUP, PluginConfigError, import_class


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What discovery knows about one installed plugin, without importing it."""

    name: str
    value: str
    distribution: str
    version: str


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
