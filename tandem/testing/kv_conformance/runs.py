"""The workload of the KV-connector conformance check and the engines that run it: the
tiny model, the engine settings, the step limit, the run without a connector."""

from __future__ import annotations

import atexit
import functools
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tandem.testing.kv_conformance.report import _Violation

Mode = Literal["sync", "async"]

#: Scheduling modes each check runs under (`async_scheduling` False / True).
MODES: tuple[Mode, ...] = ("sync", "async")
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 12
MAX_MODEL_LEN = 128
#: Engine steps one run may take before it counts as stuck (the workload needs ~100).
MAX_STEPS = 2000
BASE_PLUGINS: list[Any] = ["reference-scheduler", "default-sampler"]


# The workload -------------------------------------------------------------------------


def workload() -> list[list[list[int]]]:
    """Rounds of prompts (one `generate` each); see the package docstring."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, 200) for _ in range(n)]

    prefix, more = tokens(4 * BLOCK_SIZE), tokens(2 * BLOCK_SIZE)
    tails = [tokens(8) for _ in range(4)]
    evict = [[tokens(60) for _ in range(3)] for _ in range(2)]
    return [
        [prefix + tails[0]],
        evict[0],
        [prefix + more + tails[1], prefix + tails[2]],
        evict[1],
        [prefix + more + tails[3], prefix],
    ]


def _params() -> Any:
    from tandem import SamplingParams

    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@functools.cache
def tiny_model_dir() -> Path:
    """The tiny random Llama the checks run on, written once per process."""
    from tandem.testing.tiny_model import save_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tandem-kv-conformance-"))
    atexit.register(shutil.rmtree, root, True)
    return save_tiny_model("llama", root / "llama")


# Engines ------------------------------------------------------------------------------


class _Stuck(RuntimeError):
    """The engine ran `MAX_STEPS` steps without finishing the workload."""


@dataclass
class _Run:
    """One engine's run of the workload: tokens per request in order, `engine.stats()`,
    what `after` returned, or the error that stopped it."""

    tokens: list[list[int]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    after: Any = None
    error: str | None = None
    #: The error is `_Stuck`: the engine stopped making progress.
    stuck: bool = False


def _scheduler(llm: Any) -> Any:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0]


def _held_by_connector(link: Any) -> set[str]:
    """Finished requests whose blocks the scheduler keeps for the connector."""
    return set(link.kept) | set(getattr(link, "kept_for_load", ()))


def _stuck_message(llm: Any) -> str:
    link, kv = _scheduler(llm).kv_link, _scheduler(llm).kv_cache_manager
    kept = sorted(_held_by_connector(link))
    receiving = sorted(getattr(link, "receiving", {}))
    return (
        f"the engine ran {MAX_STEPS} steps without finishing the workload: {kv.num_free_blocks} of "
        f"{kv.num_blocks} blocks free; finished requests whose blocks the connector keeps "
        f"(never reported in get_finished): {kept or 'none'}; requests waiting for an "
        f"asynchronous load never reported received: {receiving or 'none'}"
    )


def _limit_steps(llm: Any) -> None:
    """Make the engine raise `_Stuck` once it ran `MAX_STEPS` steps (a workload needs
    about a hundred: more means it stopped making progress)."""
    engine, count = llm.engine, [0]
    inner = engine.run_step

    def run_step() -> Any:
        count[0] += 1
        if count[0] > MAX_STEPS:
            raise _Stuck(_stuck_message(llm))
        return inner()

    engine.run_step = run_step


def _run(
    plugin: str | None,
    options: Mapping[str, Any],
    mode: Mode,
    after: Callable[[Any], Any] | None = None,
    before_round: Callable[[int], None] | None = None,
) -> _Run:
    """The workload on an engine with the connector `plugin` (None: without one);
    `before_round(i)` is called before round i, `after` with the `LLM` once every round
    finished, before it shuts down."""
    from tandem import LLM

    plugins = list(BASE_PLUGINS)
    if plugin is not None:
        plugins.append({"name": plugin, "options": dict(options)})
    run = _Run()
    try:
        llm = LLM(
            model=str(tiny_model_dir()),
            num_kv_blocks=NUM_KV_BLOCKS,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            worker_num_threads=1,
            executor="inprocess",  # the probe's two sides share its log
            plugins=plugins,
            async_scheduling=mode == "async",
        )
    except Exception as exc:
        run.error = f"the engine did not start: {type(exc).__name__}: {exc}"
        return run
    _limit_steps(llm)
    try:
        for i, prompts in enumerate(workload()):
            if before_round is not None:
                before_round(i)
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False
            )
            run.tokens += [list(o.outputs[0].token_ids) for o in outs]
        run.stats = llm.engine.stats()
        run.after = after(llm) if after is not None else None
    except Exception as exc:
        run.stuck = isinstance(exc, _Stuck)
        run.error = str(exc) if run.stuck else f"{type(exc).__name__}: {exc}"
    finally:
        llm.engine.shutdown()
    return run


_REFERENCE: dict[Mode, list[list[int]]] = {}


def reference_tokens(mode: Mode) -> list[list[int]]:
    """The workload's tokens without a connector (computed once per process and mode)."""
    if mode not in _REFERENCE:
        run = _run(None, {}, mode)
        if run.error is not None:
            raise RuntimeError(f"the reference run without a connector failed: {run.error}")
        _REFERENCE[mode] = run.tokens
    return _REFERENCE[mode]


def _require_run(run: _Run) -> None:
    if run.error is not None:
        raise _Violation("the engine runs the workload with the connector", run.error)


def _require_outputs(run: _Run, mode: Mode, why: str, hint: str = "") -> None:
    expected = reference_tokens(mode)
    if run.tokens == expected:
        return
    prompts = [p for r in workload() for p in r]
    pairs = enumerate(zip(run.tokens, expected, strict=False))
    i = next((i for i, (a, b) in pairs if a != b), min(len(run.tokens), len(expected)) - 1)
    raise _Violation(
        "greedy outputs equal a run without the connector",
        f"request {i} ({len(prompts[i])}-token prompt){why}: got {run.tokens[i]}, "
        f"expected {expected[i]}: the KV it was given differs from the KV it would compute" + hint,
    )
