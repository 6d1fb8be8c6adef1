"""pytest plugin `tandem`: fixtures for testing tandem plugins against the reference engine,
and the plugin conformance suite as pytest items (the KV-connector conformance items,
`--tandem-kv-connector-conformance NAME`: `tandem.testing.kv_conformance.pytest_items`).

Registered under the `pytest11` entry point, so it is active wherever tandem is installed
(`-p tandem` loads it explicitly, e.g. with `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`).

Conformance (see `tandem.testing.conformance`)::

    python -m pytest -p tandem --tandem-conformance NAME [--tandem-conformance NAME2 ...] \\
        [--tandem-conformance-stack STACK.yaml ...] \\
        [--tandem-conformance-options 'NAME={"option": "value"}' ...]

adds one item per (check, mode) for each scheduler plugin NAME (an entry point of the
group `tandem.plugins`, or a class by its import path `module:Class`), with ids like
`tandem-conformance[NAME]::greedy-parity[async]`, and for each stack file (its `plugins:`
list, in order, as the unit under test: `tandem.testing.conformance.stack`), with ids like
`tandem-conformance-stack[STACK.yaml]::victim-starvation[sync]`. A diffusion scheduler runs on the
scripted diffusion model (`conformance/kinds.py`); what does not apply to it is skipped
with the reason "n/a: ..." (`-rs` prints it): the checks' items, plus one item
`RULE[n/a]` per rule inside the checks that does not apply.
It works in any directory, even an empty one (the items do not come from files; tests
collected from files run as usual beside them). `--tandem-conformance-options NAME=JSON`
(repeatable, once per plugin) gives the plugin NAME its options: a JSON object, for a
`--tandem-conformance NAME` or for the entry NAME of a stack (merged over the options the
file gives it). A bare JSON object (the old form) is accepted only when exactly one plugin
and no stack is named; otherwise it is a usage error, since it could not say whose
options it holds. `-k` selects items as usual, e.g.
`-k "abort and sync"`. A failed item shows the `ConformanceError`: the check, the mode,
the step, the rule, the request and its ledger.

Grammar-backend conformance (see `tandem.testing.grammar_conformance`)::

    python -m pytest -p tandem --tandem-grammar-conformance BACKEND \\
        [--tandem-grammar-conformance-corpus ci|full]

adds one item per (schema case, mode) for each grammar BACKEND (`xgrammar`, `outlines`,
`auto`, or a grammar plugin's entry-point name), with ids like
`tandem-grammar-conformance[outlines]::int-bounds[async]`; the corpus runs on the
embedded SmolLM2 once per backend, at its first item.

The test kit's plugin doubles (`scripted-drafter`, `fake-grammar`, `fault-sampler`) are
registered by class in every session (`tandem.testing.doubles`), so stacks name them.

Fixtures:
- `scripted_engine_factory`: build an `EngineCore` on the scripted model with invariant
  checks after every step (keywords override config fields).
- `reference_outputs`: `reference_outputs(workload, mode="sync")`, the outputs of a
  `conformance.Workload` on the reference scheduler (to compare a plugin's run with).
- `tiny_model_dir`: `tiny_model_dir(arch)` (llama, qwen2, qwen3) is the directory of a
  tiny random HF model built once per session (`tandem.testing.tiny_model`), for running a
  plugin on a real transformer: `LLM(model=str(tiny_model_dir("qwen2")))`.
- `ledger_trace`: `ledger_trace(engine, max_steps=10_000)` steps an engine until idle and
  returns, per step, the scheduled tokens, the outputs and every request's ledger
  (`conformance.format_ledger_trace` prints it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tandem.testing.kv_conformance import pytest_items as kv_items


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tandem", "tandem plugin conformance")
    group.addoption(
        "--tandem-conformance",
        action="append",
        default=[],
        metavar="NAME",
        help="run the tandem conformance checks on the scheduler plugin NAME "
        "(an installed plugin's name, or a class as module:Class); repeatable",
    )
    group.addoption(
        "--tandem-grammar-conformance",
        action="append",
        default=[],
        metavar="BACKEND",
        help="run the tandem grammar-backend conformance corpus on BACKEND (xgrammar, "
        "outlines, auto, or a grammar plugin's entry-point name); repeatable",
    )
    group.addoption(
        "--tandem-grammar-conformance-corpus",
        default="ci",
        choices=("ci", "full"),
        help="the schema corpus of --tandem-grammar-conformance (default: ci)",
    )
    group.addoption(
        "--tandem-conformance-stack",
        action="append",
        default=[],
        metavar="STACK.yaml",
        help="run the tandem conformance checks on a whole stack file (its plugins, in "
        "order, with their options); repeatable",
    )
    kv_items.add_options(group)
    group.addoption(
        "--tandem-conformance-options",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="options of the plugin NAME (a --tandem-conformance plugin or a stack's "
        "entry) as a JSON object; repeatable, once per plugin. A bare JSON object is "
        "accepted when exactly one plugin and no stack is named",
    )


def _json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise pytest.UsageError(f"{where}: expected a JSON object, got {text!r}")
    return value


def _conformance_options(
    config: pytest.Config, stack_names: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """The per-plugin options of `--tandem-conformance-options`, by plugin name (usage
    errors name the argument, the plugin and what was expected)."""
    names = list(config.getoption("tandem_conformance"))
    stacks = list(config.getoption("tandem_conformance_stack"))
    known = names + [n for n in stack_names or [] if n not in names]
    options: dict[str, dict[str, Any]] = {}
    for raw in config.getoption("tandem_conformance_options"):
        if raw.lstrip().startswith("{"):
            if len(names) != 1 or stacks:
                raise pytest.UsageError(
                    "--tandem-conformance-options: a bare JSON object is ambiguous with "
                    f"{len(names)} --tandem-conformance plugin(s) and {len(stacks)} stack(s); "
                    "give NAME=JSON, one per plugin (e.g. "
                    f"{(known or ['srpt-order'])[0]}='{{\"option\": 1}}')"
                )
            name, text = names[0], raw
        else:
            name, sep, text = raw.partition("=")
            name = name.strip()
            if not sep or not name:
                raise pytest.UsageError(
                    f"--tandem-conformance-options {raw!r}: expected NAME=JSON (the plugin's "
                    "name, '=', a JSON object of its options)"
                )
        where = f"--tandem-conformance-options {name}="
        if name not in known:
            raise pytest.UsageError(
                f"{where}...: no plugin {name!r} is under test; the plugins under test: "
                f"{', '.join(known) or '(none)'}"
            )
        if name in options:
            raise pytest.UsageError(f"{where}...: given twice; give each plugin's options once")
        options[name] = _json_object(text, where)
    return options


def _conformance_stacks(config: pytest.Config) -> list[Any]:
    """Each `--tandem-conformance-stack` file as a `StackUnderTest`, the per-plugin
    options merged in (a bad file or option is a usage error naming it)."""
    from tandem.schema.config import ConfigError
    from tandem.testing.conformance.stack import load_stack

    paths = config.getoption("tandem_conformance_stack")
    try:
        plain = [load_stack(path) for path in paths]
        options = _conformance_options(config, [n for s in plain for n in s.names()])
        return [
            load_stack(path, {n: o for n, o in options.items() if n in stack.names()})
            for path, stack in zip(paths, plain, strict=True)
        ]
    except ConfigError as exc:
        raise pytest.UsageError(f"--tandem-conformance-stack: {exc}") from exc


def pytest_configure(config: pytest.Config) -> None:
    from tandem.testing.doubles import register_test_plugins

    register_test_plugins()  # the doubles resolve by name in every session (idempotent)
    kv_items.check_options(config)
    if config.getoption("tandem_conformance_stack", None):
        _conformance_stacks(config)  # usage errors before anything runs
    elif config.getoption("tandem_conformance", None):
        _conformance_options(config)


class ConformanceItem(pytest.Item):
    """One conformance check of one plugin in one mode."""

    def __init__(
        self, *, plugin: Any, check: str, mode: str, options: dict[str, Any], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.plugin, self.check, self.mode, self.options = plugin, check, mode, options

    def runtest(self) -> None:
        from tandem.testing.conformance import CheckNotApplicable, check_conformance

        try:
            check_conformance(self.plugin, self.check, self.mode, self.options)  # type: ignore[arg-type]
        except CheckNotApplicable as exc:
            pytest.skip(f"n/a: {exc}")

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from tandem.testing.conformance import ConformanceError

        if isinstance(excinfo.value, ConformanceError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"tandem conformance: {self.plugin} {self.check} [{self.mode}]"


class NotApplicableItem(pytest.Item):
    """A rule of the checks that does not apply to the plugin's kind: always skipped with
    "n/a: <reason>", so `-rs` lists it (nothing is skipped silently)."""

    def __init__(self, *, reason: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        pytest.skip(f"n/a: {self.reason}")

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"tandem conformance: rule {self.name}"


class ConformanceSuite(pytest.Collector):
    """The conformance items of one plugin (not collected from a file)."""

    def __init__(self, *, plugin: Any, options: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plugin, self.options = plugin, options  # plugin: a name, or a StackUnderTest

    def collect(self) -> list[pytest.Item]:
        from tandem.testing.conformance import CHECKS, MODES, NOT_APPLICABLE, scheduler_kind

        items: list[pytest.Item] = [
            ConformanceItem.from_parent(
                self,
                name=f"{check}[{mode}]",
                plugin=self.plugin,
                check=check,
                mode=mode,
                options=self.options,
            )
            for check in CHECKS
            for mode in MODES
        ]
        rules = NOT_APPLICABLE[scheduler_kind(self.plugin)]
        items += [
            NotApplicableItem.from_parent(self, name=f"{rule}[n/a]", reason=reason)
            for rule, reason in rules.items()
            if rule not in CHECKS
        ]
        return items


class GrammarConformanceItem(pytest.Item):
    """One schema case of the grammar conformance corpus in one mode."""

    def __init__(self, *, backend: str, case: str, mode: str, corpus: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend, self.case, self.mode, self.corpus = backend, case, mode, corpus

    def runtest(self) -> None:
        from tandem.testing.grammar_conformance import check_grammar_case

        check_grammar_case(self.backend, self.case, self.mode, self.corpus)  # type: ignore[arg-type]

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        from tandem.testing.grammar_conformance import GrammarConformanceError

        if isinstance(excinfo.value, GrammarConformanceError):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        where = f"{self.backend} {self.case} [{self.mode}]"
        return self.path, None, f"tandem grammar conformance: {where}"


class GrammarConformanceSuite(pytest.Collector):
    """The grammar conformance items of one backend (not collected from a file)."""

    def __init__(self, *, backend: str, corpus: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backend, self.corpus = backend, corpus

    def collect(self) -> list[pytest.Item]:
        from tandem.testing.grammar_conformance import CORPORA, MODES

        return [
            GrammarConformanceItem.from_parent(
                self,
                name=f"{case.name}[{mode}]",
                backend=self.backend,
                case=case.name,
                mode=mode,
                corpus=self.corpus,
            )
            for case in CORPORA[self.corpus]
            for mode in MODES
        ]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the conformance items (before `-k`/`-m` deselection runs)."""
    corpus = config.getoption("tandem_grammar_conformance_corpus")
    for backend in config.getoption("tandem_grammar_conformance"):
        node = f"tandem-grammar-conformance[{backend}]"
        grammar_suite = GrammarConformanceSuite.from_parent(
            session, name=node, nodeid=node, backend=backend, corpus=corpus
        )
        collected = grammar_suite.collect()
        session.ihook.pytest_collectreport(
            report=pytest.CollectReport(node, "passed", None, collected)
        )
        items.extend(collected)
    items.extend(kv_items.collect_items(session, config))
    names = config.getoption("tandem_conformance")
    stacks = _conformance_stacks(config) if config.getoption("tandem_conformance_stack") else []
    if not names and not stacks:
        return
    options = _conformance_options(config, [n for s in stacks for n in s.names()])
    suites: list[tuple[str, Any, dict[str, Any]]] = [
        (f"tandem-conformance[{name}]", name, options.get(name, {})) for name in names
    ]
    suites += [(f"tandem-conformance-stack[{s.path}]", s, {}) for s in stacks]
    for node, plugin, plugin_options in suites:
        suite = ConformanceSuite.from_parent(
            session, name=node, nodeid=node, plugin=plugin, options=plugin_options
        )
        collected = suite.collect()
        # Report them like collected files' items, so the counts pytest prints include them.
        session.ihook.pytest_collectreport(
            report=pytest.CollectReport(node, "passed", None, collected)
        )
        items.extend(collected)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """`tiny_model_dir(arch)`: the directory of a tiny random Llama / Qwen2 / Qwen3 model
    (`tandem.testing.tiny_model`), built once per session; `LLM(model=str(path))` runs it."""
    from tandem.testing.tiny_model import save_tiny_model

    built: dict[str, Any] = {}

    def get(arch: str = "llama") -> Any:
        if arch not in built:
            built[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@pytest.fixture
def scripted_engine_factory() -> Iterator[Callable[..., Any]]:
    from tandem.testing.engine import make_scripted_engine

    engines = []

    def factory(**overrides: Any) -> Any:
        engine = make_scripted_engine(**overrides)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def reference_outputs() -> Callable[..., Any]:
    """`reference_outputs(workload, mode="sync")`: per request, (tokens, finish reason) of
    a `tandem.testing.conformance.Workload` on the reference scheduler."""
    from tandem.testing.conformance import reference_outputs as run

    return run


@pytest.fixture
def ledger_trace() -> Callable[..., Any]:
    """`ledger_trace(engine, max_steps=10_000)`: step until idle; per step the scheduled
    tokens, the outputs and every request's ledger (a list of `LedgerStep`)."""
    from tandem.testing.conformance import ledger_trace as trace

    return trace
