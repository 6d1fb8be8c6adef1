"""The worker's torch threads: an explicit setting, else OMP_NUM_THREADS, else the CPUs this
process may use; set once for the process with the in-process executor, logged once, never
lowered for the engine's own sake, and shown by `tandem config show` and `tandem generate`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.cli import main as cli_main
from tandem.config_resolution import resolve_config
from tandem.core.worker import threads
from tandem.stack_file import load_config

STACK = Path(__file__).resolve().parents[2] / "examples" / "stacks" / "scripted-sync.yaml"


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    """Every test here may change the process's thread count: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def resolved_threads(**overrides: object) -> tuple[int | None, str]:
    config = resolve_config(load_config(None, model="scripted", **overrides))
    return config.parallel.worker_num_threads, config.parallel.worker_threads_from


def test_default_is_the_cpus_this_process_may_use(
    no_omp: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert resolved_threads() == (3, "the CPUs this process may use")


def test_omp_num_threads_beats_the_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolved_threads() == (2, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested list: the outer level
    assert resolved_threads() == (4, "OMP_NUM_THREADS")


def test_unusable_omp_num_threads_falls_back_to_the_cpus(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with caplog.at_level(logging.WARNING, logger="tandem.config"):
        assert resolved_threads() == (2, "the CPUs this process may use")
    assert "OMP_NUM_THREADS" in caplog.text


def test_explicit_setting_beats_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert resolved_threads(worker_num_threads=3) == (3, "parallel.worker_num_threads")


def test_llm_never_lowers_the_callers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `LLM()` set one thread for the whole process, whatever was configured."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    llm = LLM(model="scripted", async_scheduling=False)
    assert llm.config.parallel.worker_num_threads == 2
    assert torch.get_num_threads() == 2
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert torch.get_num_threads() == 2


def test_inprocess_worker_sets_the_process_threads_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    monkeypatch.setattr(threads, "_announced_threads", None)
    with caplog.at_level(logging.INFO, logger="tandem.config"):
        LLM(model="scripted", worker_num_threads=2)
        assert torch.get_num_threads() == 2
        LLM(model="scripted", worker_num_threads=2)
    announced = [r for r in caplog.records if "torch threads" in r.getMessage()]
    assert len(announced) == 1
    message = announced[0].getMessage()
    assert "2 torch threads" in message and "parallel.worker_num_threads" in message
    assert "process's thread count" in message


def test_config_show_prints_the_resolved_threads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cli_main(["config", "show", str(STACK)]) == 0
    out = capsys.readouterr().out
    assert "# worker threads: 1 (from OMP_NUM_THREADS" in out
    assert '"worker_num_threads": 1' in out
    assert cli_main(["config", "show", str(STACK), "--threads", "3"]) == 0
    out = capsys.readouterr().out
    assert "# worker threads: 3 (from parallel.worker_num_threads" in out
    assert '"worker_num_threads": 3' in out


def test_generate_cli_reports_the_threads(
    no_omp: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    argv = ["generate", "--model", "scripted", "--token-ids", "5 6 7", "--max-tokens", "2"]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    assert "worker threads: 1 (from the CPUs this process may use; inprocess" in captured.err
    assert '"finish_reason": "length"' in captured.out
