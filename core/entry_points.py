"""Scanning installed distributions' entry points (plugins, executors, model loaders), kept
between calls until `sys.path` changes."""

from __future__ import annotations

import os
import sys
from importlib import metadata

from tandem.core.plugin_manager import ENTRY_POINT_GROUP

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
