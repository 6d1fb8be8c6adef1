"""Helpers for the end-to-end server tests: a real `tandem serve` process on 127.0.0.1.

`ServerProcess` starts `python -m tandem.cli serve MODEL --host 127.0.0.1 --port P
--worker-threads 1 ...` with `subprocess.Popen`, waits (bounded) until `/health` answers
200, and `stop()` terminates it (then kills it after a timeout); its output goes to a log
file that failures quote. Every wait here is bounded in time; nothing loops forever.

Deadlines hold on a busy machine: `scaled(seconds)` multiplies a bound meant for a quiet
machine by `machine_slowness()`, measured once per test process (how much longer than its
own CPU time a CPU-bound loop takes now: 1 on an idle machine, about 4 with eight runnable
processes on two cores). A starting server past its scaled deadline gets more time while
its processes still use CPU (it is progressing, only slowly), up to `PROGRESS_LIMIT` times
the deadline.

Also: the engine-core child process of a server, `/metrics` parsing, raw SSE reading with
httpx, and the check of an OpenAI-style error body.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
HOST = "127.0.0.1"
#: Seconds for a server to answer /health on a quiet machine (scaled: `scaled`).
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
#: A server past its health deadline whose processes used at least PROGRESS_CPU_S of CPU in
#: the last PROGRESS_WINDOW_S is still starting: it may wait up to PROGRESS_LIMIT deadlines.
PROGRESS_CPU_S = 0.5
PROGRESS_WINDOW_S = 30.0
PROGRESS_LIMIT = 3.0
#: CPU seconds of one calibration run, and how many runs `machine_slowness` takes.
CALIBRATION_CPU_S = 0.05
CALIBRATION_RUNS = 5


def _calibration_run() -> float:
    """Wall seconds over CPU seconds of a CPU-bound loop of about CALIBRATION_CPU_S."""
    wall, cpu = time.perf_counter(), time.process_time()
    total = 0
    while time.process_time() - cpu < CALIBRATION_CPU_S:
        total += sum(range(2000))
    return (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9)


@functools.cache
def machine_slowness() -> float:
    """How many times longer than on an idle machine a CPU-bound process takes now: the
    median over CALIBRATION_RUNS loops of wall time over the CPU time they got, never
    below 1. Measured once per test process, before its first server starts, so every
    deadline of a session scales by the same factor."""
    runs = sorted(_calibration_run() for _ in range(CALIBRATION_RUNS))
    return max(1.0, runs[len(runs) // 2])


def scaled(seconds: float) -> float:
    """`seconds`, a bound meant for a quiet machine, scaled by `machine_slowness()`."""
    return seconds * machine_slowness()


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (0 for a process gone),
    from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        todo += child_pids(current)
    return total


def free_port() -> int:
    """A TCP port nobody listens on now (bound then released)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def wait_for(
    probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.05
) -> T:
    """Poll `probe` until it returns something truthy (returned); AssertionError naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


class ServerProcess:
    """One `tandem serve` process. `url` is `http://127.0.0.1:<port>`; `base_url` the /v1
    root the `openai` client takes."""

    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None) -> None:
        machine_slowness()  # measured before any server of this process loads the machine
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log_path = Path(tempfile.mkstemp(prefix="tandem-serve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "tandem.cli", "serve", model]
        cmd += ["--host", HOST, "--port", str(self.port), "--worker-threads", "1", *flags]
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        child_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})})
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env, cwd=os.getcwd()
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        """Until /health answers 200; AssertionError with the log if the server exits, or
        is not healthy by `scaled(timeout_s)` and its processes stopped using CPU (no
        progress), or by PROGRESS_LIMIT times that in any case."""
        started = time.monotonic()
        deadline = scaled(timeout_s)
        #: (seconds since start, CPU seconds used), the last PROGRESS_WINDOW_S of them.
        samples: deque[tuple[float, float]] = deque()
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            now = time.monotonic() - started
            samples.append((now, tree_cpu_seconds(self.proc.pid)))
            while len(samples) > 1 and samples[1][0] <= now - PROGRESS_WINDOW_S:
                samples.popleft()
            if now >= deadline and not self._progressing(samples, now, deadline):
                break
            time.sleep(0.1)
        cpu = samples[-1][1]
        raise AssertionError(
            f"server not healthy within {now:.0f} s (deadline {timeout_s} s x machine "
            f"slowness {machine_slowness():.2f}; CPU used {cpu:.1f} s; load average "
            f"{os.getloadavg()}):\n{self.log()}"
        )

    @staticmethod
    def _progressing(samples: Iterable[tuple[float, float]], now: float, deadline: float) -> bool:
        """Past the deadline: still below PROGRESS_LIMIT deadlines and at least
        PROGRESS_CPU_S of CPU used in the last PROGRESS_WINDOW_S."""
        if now >= PROGRESS_LIMIT * deadline:
            return False
        window = [cpu for t, cpu in samples if t >= now - PROGRESS_WINDOW_S]
        return window[-1] - window[0] >= PROGRESS_CPU_S

    def log(self) -> str:
        """The server's output so far (its last 6000 characters)."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def engine_core_pids(self) -> list[int]:
        """The server's child processes that run an engine core (multiprocessing spawn
        children; the resource tracker is not one)."""
        return [pid for pid in child_pids(self.proc.pid) if "spawn_main" in cmdline(pid)]

    def stop(self) -> int | None:
        """Terminate (then kill after STOP_TIMEOUT_S); returns the exit status."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(STOP_TIMEOUT_S)
            return self.proc.returncode
        finally:
            self._log.close()
            self.log_path.unlink(missing_ok=True)


@contextmanager
def running_server(model: str, *flags: str, env: dict[str, str] | None = None) -> Iterator[Any]:
    """A healthy `ServerProcess`, stopped on exit whatever happened."""
    server = ServerProcess(model, *flags, env=env)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc; psutil when /proc lacks the children file)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    if found or not Path(f"/proc/{pid}").exists():
        return sorted(set(found))
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:  # it (or a child) exited while we looked: no live children
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# /metrics ---------------------------------------------------------------------------


def metric_values(url: str, name: str, label: str = "") -> list[float]:
    """Every sample value of metric `name` in the server's /metrics whose labels contain
    `label` (e.g. `finished_reason="abort"`; "" for any)."""
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    values = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[len(name) :].rsplit(" ", 1)[0]
            if label in labels:
                values.append(float(line.rsplit(" ", 1)[1]))
    return values


def wait_idle(url: str, timeout_s: float = 15.0) -> None:
    """Until /metrics shows no running or waiting request and an empty KV pool (within
    `scaled(timeout_s)`)."""

    def idle() -> bool:
        names = (
            "tandem:kv_cache_usage_perc",
            "tandem:num_requests_running",
            "tandem:num_requests_waiting",
        )
        samples = [metric_values(url, n) for n in names]
        return all(s and all(v == 0 for v in s) for s in samples)

    wait_for(idle, scaled(timeout_s), "the server's KV pool and queues back to empty", 0.1)


# SSE and errors -------------------------------------------------------------------------


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The `data:` payloads of an SSE stream, in order (DONE included as "[DONE]")."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]
        else:
            assert line == "", f"unexpected SSE line {line!r}"


def assert_error_body(resp: httpx.Response, status: int, *mentions: str) -> dict[str, Any]:
    """`resp` is `status` with an OpenAI-style body `{"error": {message, type, param,
    code}}` whose message names every one of `mentions` (case-insensitive)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["code"] in (status, str(status)), error
    for word in mentions:
        assert word.lower() in error["message"].lower(), (word, error)
    return error


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` (a dict is sent as JSON, bytes/str as they are) to `url + path`."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{url}{path}", content=content, headers=hdrs, timeout=30.0)


# A tiny model with a real tokenizer -------------------------------------------------------

#: What a chat model directory needs from the embedded SmolLM2 besides weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def save_tiny_chat_model(directory: Path) -> Path:
    """A 2-layer random Llama (tandem.testing.tiny_model's shape) with the embedded
    SmolLM2's vocabulary, tokenizer and chat template: chat, text prompts and stop strings
    run in seconds. The tokenizer comes from the converted SmolLM2 in tandem's cache (a
    one-time conversion of about a minute where it is missing)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from tandem.models.model_files import resolve_model_dir
    from tandem.testing.tiny_model import tiny_config

    source = resolve_model_dir("default")
    config = tiny_config("llama")
    config.vocab_size = 49152  # SmolLM2's; its BOS 1 and EOS 2 match tiny_config's
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return directory


def token_ids(choice: Any) -> list[int]:
    """The `token_ids` an openai completion choice (or stream chunk) carries (returned on
    a model without a tokenizer, as vLLM's `return_token_ids`)."""
    extra = choice.model_extra or {}
    assert isinstance(extra.get("token_ids"), list), f"no token_ids in {choice}"
    return extra["token_ids"]
