"""The four checks of the KV-connector conformance check (see the package docstring) and
its entry points, `check_kv_connector` and `run_kv_connector_conformance`."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tandem.core.plugin_manager import capability
from tandem.plugin_discovery import load_plugin_class
from tandem.testing.kv_conformance.probe import _ProbeLog, _registered, _Target
from tandem.testing.kv_conformance.report import (
    KVCheckResult,
    KVConnectorConformanceError,
    KVConnectorReport,
    _Violation,
)
from tandem.testing.kv_conformance.runs import (
    BLOCK_SIZE,
    MODES,
    Mode,
    _held_by_connector,
    _params,
    _require_outputs,
    _require_run,
    _Run,
    _run,
    _scheduler,
    workload,
)

#: Every check, in run order.
KV_CONNECTOR_CHECKS: list[str] = ["answers", "round-trip", "failure-contract", "no-leak"]


def _ask_directly(llm: Any, plugin: str) -> int:
    """Ask the engine's connector instance about every prompt of the workload, with a
    local hit of 0 and 1 block (the probe records the answers); the number of asks."""
    from tandem.testing.engine import make_request

    connector = dict(llm.engine.plugin_manager.stack)[plugin]
    prompts = [p for r in workload() for p in r]
    for i, prompt in enumerate(prompts):
        for hit in (0, BLOCK_SIZE):
            request = make_request(f"conformance-ask-{i}-{hit}", prompt)
            connector.get_num_new_matched_tokens(request, hit)
    return 2 * len(prompts)


def _check_answers(target: _Target, mode: Mode) -> dict[str, Any]:
    log = _ProbeLog()
    with target.probe(log) as name:
        run = _run(name, target.options, mode, lambda llm: _ask_directly(llm, name))
    if log.violations:
        more = f" (and {len(log.violations) - 1} more)" if len(log.violations) > 1 else ""
        raise _Violation(
            "get_num_new_matched_tokens answers whole blocks, short of the last known "
            "token, side-effect free",
            log.violations[0] + more,
        )
    _require_run(run)
    if not log.num_answers:
        raise _Violation(
            "the scheduler asks the connector at admission",
            "get_num_new_matched_tokens was never answered: the class does not implement it "
            "(with @hookimpl)",
        )
    return {"answers": log.num_answers}


def _supplied(run: _Run) -> tuple[int, int]:
    stats = run.stats
    return stats.get("kv_connector_external_hit_tokens", 0), stats.get(
        "kv_connector_failed_load_blocks", 0
    )


def _check_round_trip(target: _Target, mode: Mode) -> dict[str, Any]:
    run = _run(target.name, target.options, mode)
    _require_run(run)
    _require_outputs(run, mode, "")
    hits, failed = _supplied(run)
    if hits <= failed * BLOCK_SIZE:
        raise _Violation(
            "the connector supplies evicted prefixes",
            f"the connector supplied {hits} tokens with {failed} failed blocks "
            "(kv_connector_external_hit_tokens, kv_connector_failed_load_blocks): the "
            "workload's prefixes were evicted from the pool and reused, yet nothing was "
            "loaded from the connector",
        )
    transfers = run.stats.get("kv_connector_transfers", {})
    return {"external_hit_tokens": hits, "failed_load_blocks": failed, "transfers": transfers}


def _check_failure_contract(target: _Target, mode: Mode) -> dict[str, Any]:
    log = _ProbeLog(corrupt=True)
    last = len(workload()) - 1

    def before_round(i: int) -> None:
        log.active = i < last  # the last round's loads show what the connector serves now

    with target.probe(log) as name:
        run = _run(name, target.options, mode, before_round=before_round)
    _require_run(run)
    hits, failed = _supplied(run)
    if not log.injected:
        raise _Violation(
            "failed loads are recomputed",
            f"no load to corrupt: the connector loaded no block ({hits} external tokens)",
        )
    _require_outputs(
        run,
        mode,
        f" after loads into blocks {sorted(set(log.injected))} failed",
        " (a block computed in a step that read a failed block attended to garbage: a "
        "connector that saved it must forget it when update_connector_output reports the "
        "failure, or a later request loads wrong KV)",
    )
    if not failed:
        raise _Violation(
            "failed loads reach the scheduler",
            f"blocks {sorted(set(log.injected))} were reported failed, yet "
            "kv_connector_failed_load_blocks is 0",
        )
    return {"corrupted_blocks": len(log.injected), "failed_load_blocks": failed}


def _held_blocks(kv: Any, except_requests: set[str]) -> set[int]:
    """Blocks in use (ref count > 0 or waiting for a fence) beyond those of
    `except_requests`."""
    allowed = {b for rid in except_requests for b in kv.get_block_ids(rid)}
    held = {b.block_id for b in kv.block_pool.blocks if b.ref_cnt > 0}
    return held - allowed


def _leak_audit(llm: Any) -> list[str]:
    """Problems with the pool once the workload finished, then after one more request."""
    scheduler = _scheduler(llm)
    kv, link = scheduler.kv_cache_manager, scheduler.kv_link
    problems: list[str] = []
    kept = _held_by_connector(link)
    stray = _held_blocks(kv, kept)
    if stray or (not kept and not kv.all_blocks_free()):
        problems.append(
            f"after every request finished, blocks {sorted(stray)} are still held "
            f"({kv.num_free_blocks} of {kv.num_blocks} free, {kv.num_fenced_blocks} behind "
            f"a fence), and not by a request the connector kept ({sorted(kept) or 'none'})"
        )
    llm.generate([{"prompt_token_ids": [7, 8, 9, 10, 11]}], _params(), use_tqdm=False)
    never = kept & _held_by_connector(link)
    if never:
        problems.append(
            f"finished requests {sorted(never)} keep their blocks (request_finished "
            "answered (True, ...)) although later steps told the worker they finished: "
            "get_finished never reported them in finished_sending"
        )
    stray = _held_blocks(kv, _held_by_connector(link) - kept)
    if stray:
        problems.append(f"after one more request, blocks {sorted(stray)} are still held")
    return problems


def _check_no_leak(target: _Target, mode: Mode) -> dict[str, Any]:
    run = _run(target.name, target.options, mode, _leak_audit)
    rule = "every block is free once every request finished"
    if run.stuck:
        raise _Violation(rule, str(run.error))
    _require_run(run)
    if run.after:
        raise _Violation(rule, run.after[0])
    return {}


_CHECKS: dict[str, Callable[[_Target, Mode], dict[str, Any]]] = {
    "answers": _check_answers,
    "round-trip": _check_round_trip,
    "failure-contract": _check_failure_contract,
    "no-leak": _check_no_leak,
}


# Entry points -------------------------------------------------------------------------


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


@contextlib.contextmanager
def _target(name_or_class: str | type, options: Mapping[str, Any] | None) -> Iterator[_Target]:
    """The connector under test; a class is registered under `test-<kebab-case name>`
    for the block. Raises `_Violation` when it cannot be loaded or is no connector."""
    opts = dict(options or {})
    if isinstance(name_or_class, type):
        cls = name_or_class
        with _registered(f"test-{_kebab(cls.__name__)}", cls) as name:
            _require_connector(name, cls)
            yield _Target(name, cls, opts)
        return
    try:
        cls = load_plugin_class(name_or_class)
    except Exception as exc:
        raise _Violation("the connector loads", f"{type(exc).__name__}: {exc}") from exc
    _require_connector(name_or_class, cls)
    yield _Target(name_or_class, cls, opts)


def _require_connector(name: str, cls: type) -> None:
    role = capability(cls, "role")
    if role != "kv-connector":
        raise _Violation(
            "the plugin is a KV connector", f"{name!r} ({cls.__name__}) has role {role!r}"
        )


def _label(name_or_class: str | type) -> str:
    return name_or_class.__name__ if isinstance(name_or_class, type) else name_or_class


def check_kv_connector(
    name_or_class: str | type,
    check: str,
    mode: Mode,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one check in one mode; raise `KVConnectorConformanceError` on a violation,
    else return the run's details."""
    if check not in _CHECKS:
        raise ValueError(f"unknown check {check!r}; checks: {', '.join(KV_CONNECTOR_CHECKS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    try:
        with _target(name_or_class, options) as target:
            return _CHECKS[check](target, mode)
    except _Violation as exc:
        raise KVConnectorConformanceError(
            connector=_label(name_or_class),
            check=check,
            mode=mode,
            rule=exc.rule,
            detail=exc.detail,
        ) from None


def run_kv_connector_conformance(
    name_or_class: str | type,
    options: Mapping[str, Any] | None = None,
    checks: Sequence[str] | None = None,
    modes: Sequence[Mode] = MODES,
) -> KVConnectorReport:
    """Every check (or `checks`) in every mode (or `modes`) on the connector `name_or_class`
    (an entry point of `tandem.plugins`, `module:Class`, or a class, registered for the
    run) with `options`. Never raises for a failed check: see `KVConnectorReport.passed`
    and `raise_for_failures()`."""
    results: list[KVCheckResult] = []
    for check in checks if checks is not None else KV_CONNECTOR_CHECKS:
        for mode in modes:
            start = time.perf_counter()
            try:
                details = check_kv_connector(name_or_class, check, mode, options)
            except KVConnectorConformanceError as exc:
                results.append(KVCheckResult(check, mode, exc, time.perf_counter() - start))
                continue
            results.append(KVCheckResult(check, mode, None, time.perf_counter() - start, details))
    return KVConnectorReport(_label(name_or_class), results)
