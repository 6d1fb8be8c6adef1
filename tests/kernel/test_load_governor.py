"""The worker's thread count under the machine's load (core/worker/load_governor.py): a
fake clock and a scripted load sample, so every decision is exact."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tandem.config_resolution import resolve_config
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.load_governor import LoadGovernor, OtherCpuLoad
from tandem.core.worker.worker import Worker, load_governor
from tandem.stack_file import load_config


class Script:
    """Returns the next scripted load of other processes (cores kept busy); counts the
    calls."""

    def __init__(self, values: list[float | None]) -> None:
        self.values, self.calls = list(values), 0

    def __call__(self) -> float | None:
        self.calls += 1
        return self.values.pop(0)


def governor(
    values: list[float | None], max_threads: int = 2, cores: int = 2
) -> tuple[LoadGovernor, Script, list[float]]:
    now = [0.0]
    script = Script(values)
    gov = LoadGovernor(
        max_threads, cores, sample=script, clock=lambda: now[0], interval_s=0.5, window=3
    )
    return gov, script, now


def test_a_quiet_machine_keeps_every_thread() -> None:
    gov, script, now = governor([0, 0, 0])
    for _ in range(3):
        assert gov.threads() == 2
        now[0] += 0.5
    assert script.calls == 3


def test_a_lasting_neighbour_takes_a_thread_and_gives_it_back() -> None:
    gov, _, now = governor([0, 1, 1, 1, 0, 0, 0])
    seen = []
    for _ in range(7):
        seen.append(gov.threads())
        now[0] += 0.5
    # the fewest over the last 3 samples: 0 until three 1s in a row, then 0 again
    assert seen == [2, 2, 2, 1, 2, 2, 2]


def test_one_burst_moves_nothing() -> None:
    gov, _, now = governor([0, 0, 3, 0, 0])
    seen = []
    for _ in range(5):
        seen.append(gov.threads())
        now[0] += 0.5
    assert seen == [2] * 5


def test_samples_at_most_once_per_interval() -> None:
    gov, script, now = governor([2, 2, 2])
    for _ in range(10):
        gov.threads()
        now[0] += 0.1
    assert script.calls == 2  # t = 0 and t = 0.5


def test_never_below_one_nor_above_the_configured_count() -> None:
    gov, _, _ = governor([9], max_threads=3, cores=8)
    assert gov.threads() == 1  # 8 cores - 9 others -> at least 1
    gov, _, now = governor([0], max_threads=3, cores=8)
    assert gov.threads() == 3


def test_no_proc_keeps_the_count() -> None:
    gov, _, now = governor([None, None], max_threads=4, cores=4)
    assert gov.threads() == 4
    now[0] += 0.5
    assert gov.threads() == 4


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_threads and cores must be >= 1"):
        LoadGovernor(0, 2)


def test_a_light_neighbour_keeps_the_threads_and_half_a_core_takes_one() -> None:
    """Cores are taken in whole numbers, from half a core up: a load generator's 0.3 moves
    nothing, a neighbour at 0.6 (one busy process sharing two cores with two spinning
    threads gets about two thirds of one) takes a thread."""
    gov, _, now = governor([0.3, 0.4, 0.3, 0.6, 0.7, 0.65, 1.4])
    seen = []
    for _ in range(7):
        seen.append(gov.threads())
        now[0] += 0.5
    assert seen == [2, 2, 2, 2, 2, 1, 1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_other_cpu_load_sees_a_busy_neighbour() -> None:
    """A child spinning for a second keeps most of a core busy; the first call has no
    interval yet."""
    load = OtherCpuLoad()
    assert load() is None
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 20\nwhile time.time() < end: pass"]
    )
    try:
        seen = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(1.0)
            value = load()
            assert value is not None
            seen.append(value)
            if value >= 0.5:
                break
        assert max(seen) >= 0.5, seen
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_other_cpu_load_leaves_out_this_process() -> None:
    """This process spinning is its own work: what it adds is not counted. Measured as a
    difference against an idle interval, so a busy machine shifts both readings alike."""
    load = OtherCpuLoad()
    load()
    time.sleep(1.0)
    idle = load()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
    spinning = load()
    assert idle is not None and spinning is not None
    assert spinning < idle + 0.5, (idle, spinning)


def test_the_worker_applies_the_governors_count() -> None:
    """`parallel.yield_to_load` gives the worker a governor; each step sets its count."""
    config = resolve_config(
        load_config(model="scripted", max_model_len=32, worker_num_threads=2, yield_to_load=True)
    )
    assert load_governor(config) is not None
    one = resolve_config(load_config(model="scripted", max_model_len=32, worker_num_threads=1))
    assert load_governor(one) is None
    before = torch.get_num_threads()
    try:
        worker = Worker(config)
        assert worker.load_governor is not None
        worker.load_governor = LoadGovernor(
            2, 2, sample=lambda: 1, clock=lambda: 0.0, interval_s=0.5, window=1
        )
        worker.execute_model(SchedulerOutput(step_id=0))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
