"""The tandem kernel: engine loop, data model, hook contract, plugin manager, config,
executors. It imports no policy module: schedulers, samplers, drafters and grammar backends
are plugins loaded by name."""

from tandem.core.hookspecs import hookimpl, hookspec

__all__ = ["hookimpl", "hookspec"]
