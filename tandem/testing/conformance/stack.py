"""A whole stack file as the conformance kit's unit under test.

`load_stack(path, options)` reads a stack YAML (`tandem.stack_file.load_config`: errors
name the file, the line and the key) and keeps its `plugins:` list, each entry's options
merged key by key under the per-plugin options given for its name (`options[name]`, from
`--tandem-conformance-options NAME=JSON`). The kit then runs every check on exactly that
plugin list, in that order; the model (the scripted one) and the engine limits are the
checks' own workloads', as for a single plugin, and `check_invariants` is on. In sync mode
an async layer the file names (`role = "async-layer"`) is left out (a stack with one
needs async scheduling); in async mode the plugin manager adds the default layer when the
file names none, as it does for any stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.plugin_discovery import load_plugin_class
from tandem.schema.config import ConfigError


@dataclass(frozen=True)
class StackUnderTest:
    """The plugins of a stack file, in stack order: `(name, options)` pairs."""

    path: str
    entries: tuple[tuple[str, dict[str, Any]], ...]

    def __str__(self) -> str:
        return f"stack {self.path}"

    def names(self) -> list[str]:
        return [name for name, _ in self.entries]

    def role_of(self, name: str) -> str | None:
        try:
            return getattr(load_plugin_class(name), "role", None)
        except ConfigError:
            return None  # the engine start reports it

    def scheduler(self) -> str | None:
        """The entry with the scheduler role (its kind picks the model), or None."""
        return next((n for n in self.names() if self.role_of(n) == "scheduler"), None)

    def plugins(self, mode: str) -> list[dict[str, Any]]:
        """The stack as `plugins=` entries for `mode` (no async layer under sync)."""
        return [
            {"name": name, "options": dict(options)}
            for name, options in self.entries
            if mode == "async" or self.role_of(name) != "async-layer"
        ]


def load_stack(
    path: str | Path, options: Mapping[str, Mapping[str, Any]] | None = None
) -> StackUnderTest:
    """The stack file at `path` as a unit under test (see the module docstring). Raises
    `ConfigError` naming the file for bad YAML or a stack without `plugins:`, and naming
    the option's plugin when `options` names a plugin the stack does not hold."""
    from tandem.stack_file import load_config

    config = load_config(path)
    if not config.plugins:
        raise ConfigError(
            f"{path}: plugins: the conformance kit runs the stack's plugins, and this stack "
            "names none; list them (e.g. [reference-scheduler, my-policy, default-sampler])"
        )
    entries = [(spec.name, dict(spec.options)) for spec in config.plugins]
    names = [name for name, _ in entries]
    for name in options or {}:
        if name not in names:
            raise ConfigError(
                f"--tandem-conformance-options {name}=...: {path} has no plugin {name!r}; "
                f"its plugins: {', '.join(names)}"
            )
    merged = tuple(
        (name, {**opts, **dict((options or {}).get(name, {}))}) for name, opts in entries
    )
    return StackUnderTest(str(path), merged)
