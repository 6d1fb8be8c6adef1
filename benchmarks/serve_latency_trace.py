"""Where one request's time goes through `tandem serve`, against offline `LLM.generate`.

    python benchmarks/serve_latency_trace.py [--variant NAME=FLAGS ...] [--requests 6]
        [--concurrency 1] [--prompt-tokens 128] [--max-tokens 64] [--rounds 2]
        [--pythonpath DIR] [--py-spy DIR]

Per variant (a `tandem serve` started with FLAGS, which may begin with `KEY=VALUE`
environment settings as `env` takes them; default: one variant, `default`, with no flags): start the server on 127.0.0.1, send `--requests` rounds of `--concurrency`
streaming completions (1: one after another, batch 1; every request's prompt is the same
tokens rotated differently, so none hits the prefix cache), read each SSE event as it arrives,
stop the server. Per request: TTFT, TPOT and ITL as `tandem bench serve` measures them;
per process (API server, engine core) the CPU seconds it used while the requests ran,
divided by the tokens streamed (from /proc/PID/stat: a process that spins or polls shows
here). Beside it, offline batch-1 latency of the same prompt in a fresh process
(`LLM.generate`, `--offline-threads`, default: every usable core), so that TPOT(serve) -
ms/token(offline) is the serving overhead. Variants and the offline run alternate over
`--rounds`; medians. `--pythonpath` runs a snapshot of tandem (benchmarks/snapshot_pkg.sh)
instead of the installed tree, server and offline alike. With `--py-spy DIR`, the last
round samples both processes of each variant with py-spy (on PATH or beside the
interpreter) into DIR/<variant>-{api,core}.txt (collapsed stacks of the thread holding the
GIL: the Python work of each process).

Writes JSON to `--out` (default benchmarks/results/serve_latency_trace.json) with the CPU
model and flags, the load average before and after, and every run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from serve_compare import cpu_flags, free_port, stop, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prompt_ids(n: int, rotation: int = 0) -> list[int]:
    """`n` ordinary token ids (deterministic), rotated left by `rotation`: the same tokens
    with a different first block, so no request hits another's prefix cache."""
    ids = [100 + (i * 7919) % 30000 for i in range(n)]
    k = rotation % n
    return ids[k:] + ids[:k]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def engine_core_pid(server_pid: int) -> int | None:
    """The server's engine-core process (a multiprocessing spawn child)."""
    for pid in children(server_pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


async def timed_requests(
    base: str, prompt: list[int], max_tokens: int, count: int, concurrency: int
) -> list[dict]:
    """`count` rounds of `concurrency` streamed completions sent together (one after
    another for 1); per request TTFT/TPOT/ITL (ms)."""
    import httpx

    from tandem.bench_serve import stream_completion

    payload = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        models = (await client.get(f"{base}/v1/models")).json()["data"]
        payload["model"] = models[0]["id"]
        warm = await stream_completion(
            client, f"{base}/v1/completions", {**payload, "max_tokens": 4}
        )
        if not warm.ok:
            raise RuntimeError(f"warm-up failed: {warm.error}")
        results = []
        url = f"{base}/v1/completions"
        for i in range(count):
            batch = [
                stream_completion(client, url, {**payload, "prompt": prompt[k:] + prompt[:k]})
                for k in range(1 + i * concurrency, 1 + (i + 1) * concurrency)
            ]
            for r in await asyncio.gather(*batch):
                if not r.ok:
                    raise RuntimeError(f"request failed: {r.error}")
                results.append(
                    {
                        "ttft_ms": r.ttft * 1000,
                        "tpot_ms": (r.tpot or 0.0) * 1000,
                        "itl_p50_ms": statistics.median(r.itl) * 1000,
                        "itl_max_ms": max(r.itl) * 1000,
                        "output_tokens": r.output_tokens,
                    }
                )
        return results


def py_spy(pid: int, out: Path, seconds: float) -> subprocess.Popen:
    """Sample `pid`'s thread holding the GIL (Python work only) for `seconds`."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "200"]
    cmd += ["--duration", str(int(seconds)), "--output", str(out), "--threads", "--gil"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `KEY=VALUE` words (as `env` takes them) and the flags after them."""
    env: dict[str, str] = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isupper():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def serve_run(name: str, words: list[str], args: argparse.Namespace, spy: Path | None) -> dict:
    """Start one server, time the requests and the CPU of its processes, stop it."""
    extra_env, flags = split_env(list(words))
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--max-model-len", "512", *flags]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | QUIET_ENV
    env |= {"PYTHONPATH": args.pythonpath} if args.pythonpath else {}
    env |= extra_env
    log = Path(tempfile.mkstemp(prefix=f"serve-trace-{name}-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd="/"
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 900.0)
        time.sleep(1.0)
        core = engine_core_pid(proc.pid)
        pids = {"api": proc.pid, "core": core}
        spies = []
        if spy is not None and core is not None:
            seconds = args.requests * (args.max_tokens * 0.06 + 0.5)
            spies = [py_spy(p, spy / f"{name}-{k}.txt", seconds) for k, p in pids.items()]
        before = {k: cpu_seconds(p) for k, p in pids.items() if p}
        wall = time.perf_counter()
        prompt = prompt_ids(args.prompt_tokens)
        requests = asyncio.run(
            timed_requests(base, prompt, args.max_tokens, args.requests, args.concurrency)
        )
        wall = time.perf_counter() - wall
        used = {k: cpu_seconds(p) - before[k] for k, p in pids.items() if p}
        for s in spies:
            s.wait(timeout=600)
        tokens = sum(r["output_tokens"] for r in requests)
        budget = [line for line in log.read_text().splitlines() if "tandem serve:" in line]
        return {
            "variant": name,
            "env": extra_env,
            "flags": flags,
            "budget_line": budget[0] if budget else None,
            "requests": requests,
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in requests),
            "tpot_ms_p50": statistics.median(r["tpot_ms"] for r in requests),
            "cpu_ms_per_token": {k: v * 1000 / tokens for k, v in used.items()},
            "cpu_share_of_wall": {k: v / wall for k, v in used.items()},
        }
    finally:
        stop(proc)
        log.unlink(missing_ok=True)


OFFLINE = """
import json, sys, time, torch
from tandem import LLM, SamplingParams
threads, n, max_tokens, count = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
llm = LLM(worker_num_threads=threads, max_model_len=512)
prompt = [100 + (i * 7919) % 30000 for i in range(n)]
params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
runs = []
for k in range(1, count + 1):  # rotated: no prefix-cache hits (see prompt_ids)
    out = llm.generate([prompt[k:] + prompt[:k]], params, use_tqdm=False)[0]
    m = out.metrics
    runs.append({"ttft_ms": (m.first_token_time - m.arrival_time) * 1000,
                 "tpot_ms": (m.finished_time - m.first_token_time) * 1000 / (max_tokens - 1)})
llm.shutdown()
print(json.dumps(runs))
"""


def offline_run(args: argparse.Namespace) -> dict:
    """Batch-1 TTFT and ms/token of `LLM.generate` on the same prompt, in its own process."""
    threads = args.offline_threads or len(os.sched_getaffinity(0))
    env = {**os.environ, **QUIET_ENV, "OMP_NUM_THREADS": str(threads)}
    env |= {"PYTHONPATH": args.pythonpath} if args.pythonpath else {}
    argv = [str(threads), str(args.prompt_tokens), str(args.max_tokens), str(args.requests)]
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE, *argv],
        env=env, capture_output=True, text=True, timeout=1800, cwd="/",
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "threads": threads,
        "requests": runs,
        "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in runs),
        "tpot_ms_p50": statistics.median(r["tpot_ms"] for r in runs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", action="append", default=[], help="NAME=FLAGS (serve flags)")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=1, help="requests sent together")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--offline-threads", type=int)
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--pythonpath", help="import tandem from here (benchmarks/snapshot_pkg.sh)")
    p.add_argument("--py-spy", help="directory for py-spy samples of the last round")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/serve_latency_trace.json"))
    args = p.parse_args(argv)
    variants = [v.split("=", 1) for v in args.variant] or [["default", ""]]
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    if not args.no_offline:
        runs["offline"] = []
    load_before = os.getloadavg()
    for round_index in range(args.rounds):
        spy = Path(args.py_spy) if args.py_spy and round_index == args.rounds - 1 else None
        if spy is not None:
            spy.mkdir(parents=True, exist_ok=True)
        order = variants if round_index % 2 == 0 else variants[::-1]
        for name, flags in order:
            result = serve_run(name, shlex.split(flags), args, spy)
            print(json.dumps({k: result[k] for k in ("variant", "ttft_ms_p50", "tpot_ms_p50",
                                                     "cpu_ms_per_token")}), file=sys.stderr)  # fmt: skip
            runs[name].append(result)
        if not args.no_offline:
            runs["offline"].append(offline_run(args))
            print(json.dumps({"offline": runs["offline"][-1].get("tpot_ms_p50")}), file=sys.stderr)
    medians = {
        name: {
            key: statistics.median(r[key] for r in rs if key in r)
            for key in ("ttft_ms_p50", "tpot_ms_p50")
            if any(key in r for r in rs)
        }
        for name, rs in runs.items()
    }
    document = {
        "what": __doc__.splitlines()[0],
        "cpu": cpu_flags(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "requests_per_run": args.requests,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "medians": medians,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps({"medians": medians, "load": document["load_average_after"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
