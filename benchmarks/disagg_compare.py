"""One `tandem serve` against `tandem serve --disaggregated`, same requests, one run.

    python benchmarks/disagg_compare.py [--repeats 3] [--prompts 10] [--rate R] [--smoke]

Configs (model `default`: the embedded SmolLM2-135M, float32 KV):
- `single`: `tandem serve default`, default worker threads (its best config here: every
  core of a small machine, tandem/server/budget.py).
- `pair`: `tandem serve default --disaggregated`: a prefill server and a decode server
  (`kv-disagg`), each with its default half of the threads, behind the proxy; the decode
  server loads the prompt's full KV blocks from the prefill server over ZeroMQ/TCP.

Workload: seeded prompts of random ordinary token ids (100..40000), 300-600 tokens each, new
ones every round (so no prefix cache of either config ever hits), each sent to both configs:
`POST /v1/completions` with the token ids as prompt, `max_tokens` 32, temperature 0,
`ignore_eos`, `stream` and `return_token_ids`. Requests go one at a time (the next after the
last one's stream ended), so each is a clean single-request latency:
- TTFT: request sent -> the first SSE chunk carrying a token (for `pair` that includes the
  proxy's prefill request, the KV transfer, and the decode server's first step),
- TPOT: (last token chunk - first token chunk) / (tokens - 1),
measured by this process's httpx client (the same load generator for both). Per round: p50
and p90 over the round's requests; reported: the median of each over `--repeats` rounds and
the ratios pair/single. `--rate R` adds, per round, `--rate-requests` further new prompts at
Poisson arrivals of R requests/s (overlapping requests), reported the same way.

Order and fairness: both server sets are started once (single first, then pair; each warmed
with `--warmup` requests of their own) and stay alive for the whole run; rounds run
single/pair, pair/single, single/pair, ... (A B B A). While one set serves, the other is idle;
its processes' CPU seconds during the other's block are recorded (`idle_cpu_fraction`,
CPU-seconds per wall second) to show the idle set does not take cores from the measured one.

Greedy outputs: the token ids of every prompt from `single` and `pair` are compared
(`outputs_identical`, and the first mismatches). Pair transfer figures, from the proxy's
`/metrics` (the decode server's) over the measured rounds: `loaded_tokens` and
`load_seconds` of `tier="remote"` (the loader thread's wall time for fetch + write into the
pool) and `external_hit_tokens`; transfer time per token (load_seconds / loaded_tokens, in
us), bytes per token (2 * layers * kv_heads * head_dim * dtype bytes, from the model's
config.json) and so the effective bandwidth (bytes per token / time per token). The JSON also
records the CPU model and flags, the load average before/after and per block (another
process may share the machine), the commands, and the servers' budget lines.
Writes benchmarks/results/disagg_compare.json (`--smoke`: 1 repeat, 3 prompts, /tmp).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "disagg_compare.json"
SMOKE_OUT = Path(tempfile.gettempdir()) / "disagg_compare_smoke.json"
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
CONFIGS = ("single", "pair")
#: The decode server's counters read from the proxy's /metrics: short name -> (metric, label).
PAIR_METRICS = {
    "loaded_tokens": ("tandem:kv_connector_loaded_tokens_total", 'tier="remote"'),
    "load_seconds": ("tandem:kv_connector_load_seconds_total", 'tier="remote"'),
    "failed_loads": ("tandem:kv_connector_failed_loads_total", 'tier="remote"'),
    "external_hit_tokens": ("tandem:kv_connector_external_hit_tokens_total", ""),
    "prefix_cache_hits": ("tandem:prefix_cache_hits_total", ""),
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# Machine ---------------------------------------------------------------------------------


def cpu_flags() -> dict[str, Any]:
    """The CPU model and the SIMD flags that decide kernel speed (from /proc/cpuinfo)."""
    model, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": model, "cores": len(os.sched_getaffinity(0))} | {f: f in flags for f in wanted}


def kv_bytes_per_token() -> dict[str, Any]:
    """2 (K and V) * layers * kv heads * head dim * dtype bytes, from the converted model's
    config.json in tandem's cache (SmolLM2-135M's numbers where there is none)."""
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    found = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*" / "config.json")))
    config: dict[str, Any] = {}
    if found:
        config = json.loads(Path(found[-1]).read_text())
    layers = config.get("num_hidden_layers", 30)
    heads = config.get("num_key_value_heads", 3)
    head_dim = config.get("head_dim", 64)
    dtype = config.get("dtype", "float32")
    per_token = 2 * layers * heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    return {
        "source": found[-1] if found else "SmolLM2-135M defaults",
        "layers": layers,
        "kv_heads": heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "bytes_per_token": per_token,
    }


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children(current)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (from /proc)."""
    total = 0.0
    for current in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{current}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Servers ---------------------------------------------------------------------------------


class Server:
    """One server set (`tandem serve` or its disaggregated pair) on a free local port."""

    def __init__(self, name: str, flags: list[str], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tandem.cli", "serve", "default"]
        self.cmd += ["--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.log = log_dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each decides
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**env, **QUIET_ENV},
                start_new_session=True,
            )
        self.pids: list[int] = []

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until /health answered 200; RuntimeError (with the log) otherwise."""
        started = time.monotonic()
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() - started < timeout_s:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        self.pids = descendants(self.proc.pid)
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"{self.name}: /health not 200 within {timeout_s:.0f} s")

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid)

    def log_lines(self, marker: str | None = None, tail: int = 0) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return lines[-tail:] if tail else [line for line in lines if marker and marker in line]

    def stop(self) -> None:
        """SIGTERM to the server process only (it stops its engine core; the pair's parent
        stops its two servers), SIGKILL to its process group after 30 s; then SIGKILL to any
        of its descendants still alive after 15 s more."""
        pids = self.pids or descendants(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10.0)
        deadline = time.monotonic() + 15.0
        while (alive := [p for p in pids if _is_ours(p)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in alive:  # only processes this server started, still running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _is_ours(pid: int) -> bool:
    """Whether `pid` still runs a tandem process (not a recycled pid)."""
    try:
        return b"tandem" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def metrics(url: str) -> dict[str, float]:
    """The PAIR_METRICS counters (summed over their samples) from `url`/metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    values = dict.fromkeys(PAIR_METRICS, 0.0)
    for line in text.splitlines():
        for short, (name, label) in PAIR_METRICS.items():
            if line.startswith((name + "{", name + " ")) and label in line.rsplit(" ", 1)[0]:
                values[short] += float(line.rsplit(" ", 1)[1])
    return values


# Workload and client ---------------------------------------------------------------------


def make_prompts(seed: int, tag: str, count: int, lo: int, hi: int) -> list[list[int]]:
    """`count` prompts of lo..hi random ordinary token ids, one stream per (seed, tag)."""
    rng = random.Random(f"{seed}:{tag}")
    return [[rng.randint(100, 40_000) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed completion: its token ids, TTFT and TPOT (seconds), or an error."""
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    first = last = None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                ids = [t for c in chunk.get("choices", []) for t in (c.get("token_ids") or [])]
                if ids:
                    last = time.perf_counter()
                    first = first or last
                    tokens += ids
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if first is None or last is None:
        return {"error": "no tokens streamed"}
    tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {
        "prompt_tokens": len(prompt),
        "token_ids": tokens,
        "ttft_s": first - sent,
        "tpot_s": tpot,
        "e2e_s": last - sent,
    }


async def run_sequential(url: str, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        return [await stream_one(client, url, p, max_tokens) for p in prompts]


async def run_rate(
    url: str, prompts: list[list[int]], max_tokens: int, rate: float, seed: int
) -> list[Any]:
    """The prompts at Poisson arrivals of `rate` requests/s (seeded gaps)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0), trust_env=False, limits=limits
    ) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(stream_one(client, url, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


# Statistics ------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile `q` (0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p90 of TTFT and TPOT (ms) over one block's requests."""
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    tpot = [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None]
    return {
        "requests": len(results),
        "errors": [r["error"] for r in results if "error" in r],
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p90": percentile(ttft, 90),
        "tpot_ms_p50": percentile(tpot, 50),
        "tpot_ms_p90": percentile(tpot, 90),
        "ttft_ms": [round(v, 2) for v in ttft],
        "tpot_ms": [round(v, 3) for v in tpot],
    }


def median_of(blocks: list[dict[str, Any]]) -> dict[str, float | None]:
    keys = ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90")
    out: dict[str, float | None] = {}
    for key in keys:
        values = [b[key] for b in blocks if b.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def ratios(pair: dict[str, Any], single: dict[str, Any]) -> dict[str, float | None]:
    return {
        key: (pair[key] / single[key]) if pair.get(key) and single.get(key) else None
        for key in single
    }


def compare_outputs(
    single: list[dict[str, Any]], pair: list[dict[str, Any]], where: str
) -> list[dict[str, Any]]:
    """The prompts whose greedy token ids differ between the configs (or failed)."""
    mismatches = []
    for i, (a, b) in enumerate(zip(single, pair, strict=True)):
        ids_a, ids_b = a.get("token_ids"), b.get("token_ids")
        if ids_a is None or ids_b is None or ids_a != ids_b:
            first = next(
                (
                    j
                    for j, (x, y) in enumerate(zip(ids_a or [], ids_b or [], strict=False))
                    if x != y
                ),
                None,
            )
            mismatches.append(
                {"where": where, "prompt": i, "first_differing_token": first}
                | {"single": ids_a, "pair": ids_b}
            )
    return mismatches


# The run ---------------------------------------------------------------------------------


def run_block(
    server: Server,
    idle: Server,
    prompts: list[list[int]],
    args: argparse.Namespace,
    rate_prompts: list[list[int]],
    rate_seed: int,
) -> dict[str, Any]:
    """One config's share of a round; the idle set's CPU use meanwhile."""
    idle_cpu, wall = idle.cpu_seconds(), time.monotonic()
    load = os.getloadavg()[0]
    before = metrics(server.url) if server.name == "pair" else None
    seq = asyncio.run(run_sequential(server.url, prompts, args.max_tokens))
    rate: list[Any] = []
    if args.rate:
        rate = asyncio.run(
            run_rate(server.url, rate_prompts, args.max_tokens, args.rate, rate_seed)
        )
    elapsed = time.monotonic() - wall
    block: dict[str, Any] = {
        "sequential": summarize(seq),
        "load_average_1m_before": load,
        "wall_s": elapsed,
        "idle_peer_cpu_fraction": (idle.cpu_seconds() - idle_cpu) / elapsed,
        "_seq": seq,
        "_rate": rate,
    }
    if rate:
        block["rate"] = summarize(rate)
    if before is not None:
        time.sleep(args.metrics_settle)  # the engine's stats reach /metrics between steps
        after = metrics(server.url)
        block["pair_counters"] = {k: after[k] - before[k] for k in after}
    return block


def transfer_figures(counters: dict[str, float], bytes_per_token: int) -> dict[str, Any]:
    tokens, seconds = counters["loaded_tokens"], counters["load_seconds"]
    us = seconds / tokens * 1e6 if tokens else None
    return {
        **counters,
        "transfer_us_per_token": us,
        "bytes_per_token": bytes_per_token,
        "effective_bandwidth_MB_s": (bytes_per_token / us) if us else None,  # B/us = MB/s
        "effective_bandwidth_GiB_s": (bytes_per_token / us * 1e6 / 2**30) if us else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args.repeats, args.prompts, args.warmup = 1, 3, 1
        args.rate_requests = min(args.rate_requests, 3)
        args.out = args.out or str(SMOKE_OUT)
    out = Path(args.out or OUT)
    log_dir = Path(tempfile.mkdtemp(prefix="disagg_compare-"))
    print(f"disagg_compare: logs in {log_dir}", file=sys.stderr)
    load_before, started = os.getloadavg(), time.monotonic()
    kv = kv_bytes_per_token()
    servers: dict[str, Server] = {}
    document: dict[str, Any] = {
        "what": __doc__.split("\n\n", 2)[2].strip() if __doc__ else "",
        "cpu": cpu_flags(),
        "model": "default",
        "kv": kv,
        "settings": {k: v for k, v in vars(args).items() if k != "smoke"} | {"smoke": args.smoke},
        "fairness": "both server sets started once (single, then pair) and alive for the "
        "whole run; while one serves the other is idle (its CPU use is recorded per block as "
        "idle_peer_cpu_fraction); rounds alternate single/pair, pair/single (A B B A)",
        "load_average_before": load_before,
    }
    try:
        for name, flags in (("single", []), ("pair", ["--disaggregated"])):
            servers[name] = Server(name, flags + args.extra_flag, log_dir)
            try:
                seconds = servers[name].wait_healthy(args.startup_timeout)
            except RuntimeError as exc:
                document["error"] = {"server": name, "message": str(exc)}
                document["log_tail"] = servers[name].log_lines(tail=60)
                return _write(out, document, 1)
            print(f"disagg_compare: {name} healthy in {seconds:.1f} s", file=sys.stderr)
            warm = make_prompts(args.seed, "warmup", args.warmup, args.min_len, args.max_len)
            warm_results = asyncio.run(run_sequential(servers[name].url, warm, args.max_tokens))
            errors = [r["error"] for r in warm_results if "error" in r]
            document.setdefault("startup", {})[name] = {
                "command": servers[name].cmd,
                "healthy_after_s": seconds,
                "warmup_errors": errors,
            }
        rounds = _rounds(args, servers, document)
    finally:
        for server in servers.values():
            server.stop()
    for name, server in servers.items():
        lines = server.log_lines("tandem serve:") + server.log_lines("tandem: prefill")
        lines += server.log_lines("kv-disagg") + server.log_lines("Traceback")
        document["startup"][name]["log_lines"] = lines[:20]
        document["startup"][name]["log_errors"] = server.log_lines("ERROR")[:20]
    document.update(_report(args, rounds, kv["bytes_per_token"]))
    document["load_average_after"] = os.getloadavg()
    document["run_seconds"] = time.monotonic() - started
    return _write(out, document, 0)


def _rounds(
    args: argparse.Namespace, servers: dict[str, Server], document: dict[str, Any]
) -> list[dict[str, Any]]:
    rounds = []
    for r in range(args.repeats):
        prompts = make_prompts(args.seed, f"round{r}", args.prompts, args.min_len, args.max_len)
        rate_prompts = make_prompts(
            args.seed, f"rate{r}", args.rate_requests, args.min_len, args.max_len
        )
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        blocks: dict[str, Any] = {"order": list(order)}
        for name in order:
            idle = servers["pair" if name == "single" else "single"]
            print(f"disagg_compare: round {r + 1}/{args.repeats}: {name}", file=sys.stderr)
            blocks[name] = run_block(servers[name], idle, prompts, args, rate_prompts, r)
            print(
                f"  {name}: {json.dumps(median_of([blocks[name]['sequential']]))}",
                file=sys.stderr,
            )
        blocks["mismatches"] = compare_outputs(
            blocks["single"].pop("_seq"), blocks["pair"].pop("_seq"), f"round{r}"
        )
        blocks["mismatches"] += compare_outputs(
            blocks["single"].pop("_rate"), blocks["pair"].pop("_rate"), f"rate{r}"
        )
        rounds.append(blocks)
    return rounds


def _report(
    args: argparse.Namespace, rounds: list[dict[str, Any]], bytes_per_token: int
) -> dict[str, Any]:
    medians = {
        name: {"sequential": median_of([r[name]["sequential"] for r in rounds])} for name in CONFIGS
    }
    ratio = {"sequential": ratios(medians["pair"]["sequential"], medians["single"]["sequential"])}
    if args.rate:
        for name in CONFIGS:
            medians[name]["rate"] = median_of([r[name]["rate"] for r in rounds])
        ratio["rate"] = ratios(medians["pair"]["rate"], medians["single"]["rate"])
    totals = dict.fromkeys(PAIR_METRICS, 0.0)
    for r in rounds:
        for key, value in r["pair"].get("pair_counters", {}).items():
            totals[key] += value
    prompts = [
        make_prompts(args.seed, f"{tag}{i}", n, args.min_len, args.max_len)
        for i in range(args.repeats)
        for tag, n in (("round", args.prompts), ("rate", args.rate_requests if args.rate else 0))
    ]
    expected = sum((len(p) - 1) // 16 * 16 for group in prompts for p in group)
    mismatches = [m for r in rounds for m in r["mismatches"]]
    return {
        "medians": medians,
        "ratios_pair_over_single": ratio,
        "outputs_identical": not mismatches,
        "mismatches": mismatches[:5],
        "mismatch_count": len(mismatches),
        "pair_transfer": transfer_figures(totals, bytes_per_token)
        | {"expected_loaded_tokens_full_blocks": expected},
        "idle_peer_cpu_fraction_max": max(
            r[name]["idle_peer_cpu_fraction"] for r in rounds for name in CONFIGS
        ),
        "rounds": rounds,
    }


def _write(out: Path, document: dict[str, Any], status: int) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    summary = {
        k: document.get(k)
        for k in ("medians", "ratios_pair_over_single", "outputs_identical", "pair_transfer")
    }
    print(json.dumps(summary, indent=2))
    print(f"disagg_compare: wrote {out}", file=sys.stderr)
    return status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="rounds (A B, B A, ...)")
    p.add_argument("--prompts", type=int, default=10, help="sequential prompts per round")
    p.add_argument("--min-len", type=int, default=300, help="prompt tokens, at least")
    p.add_argument("--max-len", type=int, default=600, help="prompt tokens, at most")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="requests per server before round 1")
    p.add_argument("--rate", type=float, default=0.0, help="also Poisson arrivals at R req/s")
    p.add_argument("--rate-requests", type=int, default=10, help="per round, with --rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-settle", type=float, default=1.0, help="s before reading counters")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--extra-flag", action="append", default=[], help="a flag for both configs")
    p.add_argument("--smoke", action="store_true", help="1 repeat, 3 prompts, writes to /tmp")
    p.add_argument("--out", help=f"JSON path (default {OUT})")
    return p


if __name__ == "__main__":
    sys.exit(main())
