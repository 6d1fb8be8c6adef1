"""The tandem kernel: engine loop, data model, hook contract, plugin manager, executors. It
imports no policy module: schedulers, samplers, drafters, grammars are plugins, by name."""

from tandem.core.hookspecs import hookimpl, hookspec

__all__ = ["hookimpl", "hookspec"]
