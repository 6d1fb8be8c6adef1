"""The KV-connector conformance check as pytest items, for the pytest plugin `tandem`
(`tandem.testing.pytest_plugin` calls `add_options`, `check_options` and `collect_items`)::

    python -m pytest -p tandem --tandem-kv-connector-conformance NAME \\
        [--tandem-kv-connector-options JSON]

adds one item per (check, mode) for each KV connector NAME (an entry point of
`tandem.plugins`, or `module:Class`), with ids like
`tandem-kv-connector-conformance[NAME]::round-trip[async]`; the JSON object is every
named connector's options.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing.kv_conformance.checks import KV_CONNECTOR_CHECKS, check_kv_connector
from tandem.testing.kv_conformance.report import KVConnectorConformanceError
from tandem.testing.kv_conformance.runs import MODES

OPTIONS_FLAG = "--tandem-kv-connector-options"


def add_options(group: Any) -> None:
    """Add `--tandem-kv-connector-conformance` and `--tandem-kv-connector-options` to the
    plugin's option group."""
    group.addoption(
        "--tandem-kv-connector-conformance",
        action="append",
        default=[],
        metavar="NAME",
        help="run the tandem KV-connector conformance checks on the connector NAME (an "
        "installed plugin's name, or module:Class); repeatable",
    )
    group.addoption(
        OPTIONS_FLAG,
        default="{}",
        metavar="JSON",
        help="options of the --tandem-kv-connector-conformance connectors, a JSON object",
    )


def _parse_options(text: str) -> dict[str, Any]:
    from tandem.testing.pytest_plugin import _json_object  # that module imports this one

    return _json_object(text, OPTIONS_FLAG)


def check_options(config: pytest.Config) -> None:
    """A usage error, before anything runs, when `--tandem-kv-connector-options` is no JSON
    object."""
    raw = config.getoption("tandem_kv_connector_options", None)
    if raw is not None:
        _parse_options(raw)


class KVConnectorConformanceItem(pytest.Item):
    """One KV-connector conformance check of one connector in one mode."""

    def __init__(
        self, *, connector: str, check: str, mode: str, options: dict[str, Any], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.connector, self.check, self.mode, self.options = connector, check, mode, options

    def runtest(self) -> None:
        check_kv_connector(self.connector, self.check, self.mode, self.options)  # type: ignore[arg-type]

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, KVConnectorConformanceError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        where = f"{self.connector} {self.check} [{self.mode}]"
        return self.path, None, f"tandem KV-connector conformance: {where}"


class KVConnectorConformanceSuite(pytest.Collector):
    """The KV-connector conformance items of one connector (not collected from a file)."""

    def __init__(self, *, connector: str, options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connector, self.options = connector, options

    def collect(self) -> list[pytest.Item]:
        return [
            KVConnectorConformanceItem.from_parent(
                self,
                name=f"{check}[{mode}]",
                connector=self.connector,
                check=check,
                mode=mode,
                options=self.options,
            )
            for check in KV_CONNECTOR_CHECKS
            for mode in MODES
        ]


def collect_items(session: pytest.Session, config: pytest.Config) -> list[pytest.Item]:
    """The items of `--tandem-kv-connector-conformance`, reported as collected."""
    options = _parse_options(config.getoption("tandem_kv_connector_options"))
    items: list[pytest.Item] = []
    for name in config.getoption("tandem_kv_connector_conformance"):
        node = f"tandem-kv-connector-conformance[{name}]"
        suite = KVConnectorConformanceSuite.from_parent(
            session, name=node, nodeid=node, connector=name, options=options
        )
        collected = suite.collect()
        session.ihook.pytest_collectreport(
            report=pytest.CollectReport(node, "passed", None, collected)
        )
        items += collected
    return items
