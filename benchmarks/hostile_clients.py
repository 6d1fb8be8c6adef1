"""A normal client's latency alone and beside hostile clients, on one live `tandem serve`.

One server (a tiny random Llama with the embedded SmolLM2's tokenizer and chat template,
127.0.0.1, `--limit-concurrency 128 --timeout-request-header 2
--trust-request-chat-template`) answers a normal client: `--requests` sequential chat
requests of `--tokens` greedy tokens each, first alone, then while hostile clients run
beside it in bounded loops:

- **flood**: 300 idle sockets opened, held 3 s, closed, again;
- **slowloris**: 20 connections dribbling a header line every 0.5 s, reopened when closed;
- **bad_words**: chat requests with 1,000 bad words each (the most allowed is 1,024);
- **templates**: /tokenize with a nested-loop request template (stopped by the budget);
- **junk**: deep JSON, huge lists, lone surrogates, keyless requests (all refused).

The hostile loops run in a process of their own, so the normal client's process measures
the server, not its own threads' contention. That process runs at `--attacker-nice`
(default 19): a real attacker's client code runs on its own machine, while here its Python
loops (about 0.7 of the 2 cores) would compete with the server for the CPU; at nice 19 it
takes only what the server and the normal client leave, and every request it sends is
still served in full. `--attacker-nice 0` measures the attacker as an equal neighbour.

Runs `--rounds` pairs (alone, then under attack: external load on a shared machine drifts,
so each pair is compared with itself) and, with `--ablation`, one pair per hostile loop on
its own. Writes benchmarks/results/hostile_clients.json: per pair the normal client's
median and p90 alone and under attack and their ratio (the goal: the median of the pairs'
ratios within 2x), the CPU the server and the attacker used meanwhile, the load average,
what each hostile loop did, the thread counts and the CPU flags.

    python benchmarks/hostile_clients.py [--requests 30] [--tokens 8] [--rounds 3] [--ablation]
        [--attacker-nice 19]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "server"))

from e2e_helpers import ServerProcess, save_tiny_chat_model  # noqa: E402
from hostile_helpers import close_all, dribble, open_idle, start_slowloris  # noqa: E402

KEY = "sk-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}]}
LOOPS = ("flood", "slowloris", "bad_words", "templates", "junk")
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def normal_latencies(url: str, count: int, tokens: int) -> list[float]:
    """`count` sequential chat requests on one kept-alive connection; seconds each."""
    body = {**CHAT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    out: list[float] = []
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        c.post("/v1/chat/completions", json=body).raise_for_status()  # warm
        for _ in range(count):
            start = time.perf_counter()
            r = c.post("/v1/chat/completions", json=body)
            out.append(time.perf_counter() - start)
            r.raise_for_status()
    return out


class Hostile:
    """One bounded hostile loop in a thread; `counts` says what it did."""

    def __init__(self, name: str, step: Callable[[Hostile], None]) -> None:
        self.name, self.step = name, step
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"iterations": 0, "errors": 0}
        self.thread = threading.Thread(target=self._run, name=f"hostile-{name}", daemon=True)

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def _run(self) -> None:
        deadline = time.monotonic() + 900  # a hard bound whatever happens
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                self.step(self)
            except Exception:  # noqa: BLE001 - a hostile client expects failures
                self.count("errors")
            self.count("iterations")


def flood(port: int) -> Callable[[Hostile], None]:
    def step(h: Hostile) -> None:
        socks = open_idle(port, 300, timeout_s=2.0)
        h.count("sockets", len(socks))
        h.stop.wait(3.0)
        close_all(socks)

    return step


def slowloris(port: int) -> Callable[[Hostile], None]:
    socks: list[Any] = []

    def step(h: Hostile) -> None:
        if h.counts["iterations"] % 6 == 0:  # every 3 s: the server closed them by now
            close_all(socks)
            socks[:] = start_slowloris(port, 20)
            h.count("sockets", len(socks))
        dribble(socks)
        h.stop.wait(0.5)
        if h.stop.is_set():
            close_all(socks)

    return step


def requests_loop(url: str, route: str, bodies: list[Any]) -> Callable[[Hostile], None]:
    def step(h: Hostile) -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            for body in bodies:
                if h.stop.is_set():
                    return
                headers = {"content-type": "application/json", **body.get("headers", {})}
                r = c.post(route, content=body["content"], headers=headers)
                h.count(f"status_{r.status_code}")

    return step


def hostile_loops(url: str, port: int) -> list[Hostile]:
    words = [f"word{i} thing{i}" for i in range(1000)]
    bad_words = json.dumps({**CHAT, "max_tokens": 4, "bad_words": words})
    nested = json.dumps({**CHAT, "chat_template": NESTED})
    deep = '{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    junk = [
        {"content": deep, "headers": AUTH},
        {"content": json.dumps({"prompt": "hi", "stop": ["s"] * 5000}), "headers": AUTH},
        {"content": json.dumps({"prompt": "\ud800"}), "headers": AUTH},
        {"content": json.dumps({"prompt": "no key"})},
    ]
    return [
        Hostile("flood", flood(port)),
        Hostile("slowloris", slowloris(port)),
        Hostile("bad_words", requests_loop(url, "/v1/chat/completions",
                                           [{"content": bad_words, "headers": AUTH}])),
        Hostile("templates", requests_loop(url, "/tokenize", [{"content": nested,
                                                               "headers": AUTH}])),
        Hostile("junk", requests_loop(url, "/v1/completions", junk)),
    ]  # fmt: skip


def run_hostile(
    url: str, port: int, names: list[str], stop: Any, results: Any, nice: int = 0
) -> None:
    """The hostile loops named, in their own process (the normal client's process stays
    quiet: its latency is the server's, not its own threads' GIL contention) at niceness
    `nice`, until `stop`."""
    os.nice(nice)
    loops = [h for h in hostile_loops(url, port) if h.name in names]
    for h in loops:
        h.thread.start()
    stop.wait(900)
    for h in loops:
        h.stop.set()
    for h in loops:
        h.thread.join(60)
    results.put({h.name: h.counts for h in loops})


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its children so far."""
    import psutil

    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            times = p.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        pass
    return total


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "median_s": statistics.median(ordered),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_s": ordered[-1],
    }


def cpu_flags() -> list[str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    for line in text.splitlines():
        if line.startswith("Flags:"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
    return []


def attack_round(
    server: ServerProcess, loops: list[str], requests: int, tokens: int, nice: int
) -> dict[str, Any]:
    """One pair: the normal client alone, then beside the hostile `loops` (their own
    process, started 5 s before the measurement)."""
    alone = normal_latencies(server.url, requests, tokens)
    ctx = multiprocessing.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Queue()
    attacker = ctx.Process(
        target=run_hostile, args=(server.url, server.port, loops, stop, counts, nice)
    )
    attacker.start()
    time.sleep(5.0)  # let every loop get going
    try:
        cpu_before = (cpu_seconds(server.proc.pid), cpu_seconds(attacker.pid or 0))
        wall_start = time.perf_counter()
        attacked = normal_latencies(server.url, requests, tokens)
        wall = time.perf_counter() - wall_start
        cpu_after = (cpu_seconds(server.proc.pid), cpu_seconds(attacker.pid or 0))
        health = httpx.get(f"{server.url}/health", timeout=30).status_code
    finally:
        stop.set()
        hostile = counts.get(timeout=120)
        attacker.join(60)
    alone_s, attacked_s = summary(alone), summary(attacked)
    return {
        "loops": loops,
        "alone": alone_s,
        "under_attack": attacked_s,
        "ratio_median": attacked_s["median_s"] / alone_s["median_s"],
        "health_during_attack": health,
        "cpu_cores_during_attack": {
            "server": (cpu_after[0] - cpu_before[0]) / wall,
            "attacker": (cpu_after[1] - cpu_before[1]) / wall,
        },
        "load_average": os.getloadavg(),
        "hostile": hostile,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="pairs with all loops at once")
    parser.add_argument(
        "--ablation", action="store_true", help="also one pair per loop, each alone"
    )
    parser.add_argument(
        "--attacker-nice", type=int, default=19, help="niceness of the hostile clients' process"
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "hostile_clients.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tandem-hostile-") as tmp:
        model_dir = save_tiny_chat_model(Path(tmp))
        flags = [
            "--served-model-name", MODEL, "--max-num-seqs", "8", "--max-model-len", "512",
            "--api-key", KEY, "--limit-concurrency", "128", "--timeout-request-header", "2",
            "--trust-request-chat-template",
        ]  # fmt: skip
        server = ServerProcess(str(model_dir), *flags)
        try:
            server.wait_ready()
            rounds = [
                attack_round(server, list(LOOPS), args.requests, args.tokens, args.attacker_nice)
                for _ in range(args.rounds)
            ]
            ablation = (
                [
                    attack_round(server, [name], args.requests, args.tokens, args.attacker_nice)
                    for name in LOOPS
                ]
                if args.ablation
                else []
            )
            after = normal_latencies(server.url, 5, args.tokens)
        finally:
            server.stop()
    ratios = [r["ratio_median"] for r in rounds]
    result = {
        "what": "a normal client's chat latency alone vs beside hostile clients, one server; "
        "pairs of runs (alone, then under attack), ratio of medians per pair",
        "command": f"python benchmarks/hostile_clients.py --requests {args.requests} "
        f"--tokens {args.tokens} --rounds {args.rounds} --attacker-nice {args.attacker_nice}"
        + (" --ablation" if args.ablation else ""),
        "attacker_nice": args.attacker_nice,
        "ratio_median_of_pairs": statistics.median(ratios),
        "ratios": ratios,
        "goal": "ratio_median_of_pairs <= 2.0",
        "ablation_ratio_per_loop": {r["loops"][0]: r["ratio_median"] for r in ablation},
        "normal_after_attack_median_s": statistics.median(after),
        "server": {
            "flags": flags,
            "threads": "API server: event loop + 2 preprocessing threads; engine core: "
            "busy loop + 2 I/O threads; worker: 1 torch thread",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "python": platform.python_version(),
        },
        "rounds": rounds,
        "ablation": ablation,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    keys = ("ratio_median_of_pairs", "ratios", "ablation_ratio_per_loop")
    print(json.dumps({k: result[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
