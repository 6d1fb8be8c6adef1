"""`parallel.cpu_bind`: pinning the worker's OpenMP threads to CPUs.

The list rules (`auto` takes the last CPUs this process may use, an explicit list must
name one CPU per thread), the errors naming the key, and, in a child process (pinning
changes the pinned process for good), that the threads of torch's OpenMP team really run
on the CPUs asked for, with both the in-process and the process executor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.config_resolution import resolve_config
from tandem.core.worker.cpu_affinity import allowed_cpus, cpu_list, parse_cpu_list
from tandem.schema.config import ConfigError
from tandem.stack_file import load_config

CPUS = allowed_cpus()


def test_cpu_lists_parse_ranges_and_singles() -> None:
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]
    for bad in ("", "a-b", "1-", "0,,1"):
        with pytest.raises(ValueError, match="expected 'none', 'auto' or a CPU list"):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="names a CPU twice"):
        parse_cpu_list("0-2,1")


def test_auto_takes_the_last_cpus_and_none_pins_nothing() -> None:
    assert cpu_list("none", 1) is None
    assert cpu_list("auto", 1) == CPUS[-1:]
    assert cpu_list("auto", len(CPUS)) == CPUS
    with pytest.raises(ValueError, match="one CPU per worker thread"):
        cpu_list("auto", len(CPUS) + 1)
    with pytest.raises(ValueError, match="expected 2 CPUs"):
        cpu_list("0-2", 2)


def test_bad_cpu_bind_fails_as_the_config_resolves() -> None:
    with pytest.raises(ConfigError, match="parallel.cpu_bind"):
        resolve_config(load_config(None, model="scripted", cpu_bind="0-x"))
    with pytest.raises(ConfigError, match="parallel.cpu_bind: expected 1 CPUs"):
        resolve_config(load_config(None, model="scripted", worker_num_threads=1, cpu_bind="0-1"))
    config = resolve_config(load_config(None, model="scripted", worker_num_threads=1))
    assert config.parallel.cpu_bind == "none"


CHILD = """
import json, sys, torch
from tandem import LLM, SamplingParams
from tandem.core.worker.cpu_affinity import thread_cpus
threads, executor = int(sys.argv[1]), sys.argv[2]
llm = LLM(model="scripted", worker_num_threads=threads, cpu_bind="auto", executor=executor)
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
report = {"tokens": len(out[0].outputs[0].token_ids)}
if executor == "inprocess":
    report["cpus"] = [thread_cpus(threads) for _ in range(3)]
else:  # the CPUs each descendant's main thread may run on (a worker from the fork server
    # is a grandchild)
    import os, pathlib
    procs = {}
    for status in pathlib.Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        procs[status.parent.name] = fields
    ours, allowed = {str(os.getpid())}, []
    for _ in range(3):
        ours |= {pid for pid, f in procs.items() if f.get("PPid", "").strip() in ours}
    for pid in ours - {str(os.getpid())}:
        allowed.append(procs[pid]["Cpus_allowed_list"].strip())
    report["children_allowed"] = allowed
llm.shutdown()
print(json.dumps(report))
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs this process may use")
@pytest.mark.parametrize("threads", [1, 2])
def test_pinned_threads_run_on_the_auto_cpus(threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads), "inprocess"],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 3
    assert report["cpus"] == [CPUS[-threads:]] * 3


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs this process may use")
def test_process_executor_pins_in_the_worker_process() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "1", "process"],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens"] == 3
    assert str(CPUS[-1]) in report["children_allowed"]  # the worker, pinned to the last CPU
