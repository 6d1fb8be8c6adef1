"""Inter-token latency of 8 streams alone and beside a stalled reader, on one live
`tandem serve scripted` (the timing half of the e2e test
`test_a_stalled_reader_does_not_hold_up_the_others`, which asserts only behaviour).

The stalled reader is a raw socket with a 4 kB receive buffer that sends a streaming
request (1 sequence x 1000 tokens, 20 logprobs: about 1.3 kB of events per token) and never
reads, so the server's writes to it block while its request keeps running. Each round runs
the 8 greedy streams of `--tokens` tokens alone, then beside a fresh stalled reader;
`--rounds` pairs (external load on a shared machine drifts, so each pair is compared with
itself). Per stream the mean inter-token latency is the span from its first chunk to its
last over its tokens after the first; a run's figure is the median over its streams.
Writes benchmarks/results/stalled_reader.json: per pair both figures and their ratio, the
median of the ratios (the goal: close to 1; the e2e test asserted below 3 before it
became behavioural), the load average and the CPU flags.

    python benchmarks/stalled_reader.py [--rounds 5] [--tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
OUT = ROOT / "benchmarks" / "results" / "stalled_reader.json"
HOST = "127.0.0.1"
STREAMS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def start_server(port: int, log: Any) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "scripted", "--host", HOST]
    cmd += ["--port", str(port), "--worker-threads", "1", "--max-num-seqs", "64"]
    cmd += ["--max-model-len", "4096"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://{HOST}:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("tandem serve not healthy within 600 s")


def stalled_reader(port: int) -> socket.socket:
    body = json.dumps(
        {
            "model": "scripted",
            "prompt": [1, 2, 3],
            "max_tokens": 1000,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((HOST, port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


async def one_stream(client: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> float:
    """Mean seconds per token after the first chunk of one greedy stream."""
    body = {"model": "scripted", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    arrivals: list[tuple[float, int]] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                count = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                arrivals.append((time.perf_counter(), count))
    got = sum(n for _, n in arrivals)
    if got != tokens:
        raise RuntimeError(f"a stream returned {got} tokens, expected {tokens}")
    return (arrivals[-1][0] - arrivals[0][0]) / max(1, got - arrivals[0][1])


def streams_itl(url: str, tokens: int) -> float:
    """The median over STREAMS concurrent streams of their inter-token latency."""

    async def main() -> list[float]:
        async with httpx.AsyncClient(timeout=600) as client:
            prompts = [[3 + i, 7 + 13 * i % 90, 11, 20 + i % 7, 1 + i % 5] for i in range(STREAMS)]
            return await asyncio.gather(*(one_stream(client, url, p, tokens) for p in prompts))

    return statistics.median(asyncio.run(main()))


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        running = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("tandem:num_requests_running")
        ]
        if running and all(v == 0 for v in running):
            return
        time.sleep(0.1)
    raise RuntimeError("the server did not go idle within 120 s")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return sorted(f for f in flags if f in {"avx", "avx2", "fma", "avx512f", "avx512_bf16"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    port = free_port()
    url = f"http://{HOST}:{port}"
    pairs = []
    with tempfile.TemporaryFile() as log:
        server = start_server(port, log)
        try:
            for _ in range(args.rounds):
                alone = streams_itl(url, args.tokens)
                wait_idle(url)
                stalled = stalled_reader(port)
                try:
                    beside = streams_itl(url, args.tokens)
                finally:
                    stalled.close()
                wait_idle(url)
                pairs.append(
                    {
                        "alone_itl_ms": round(alone * 1e3, 3),
                        "beside_stalled_itl_ms": round(beside * 1e3, 3),
                        "ratio": round(beside / alone, 3),
                        "load_1min": os.getloadavg()[0],
                    }
                )
                print(pairs[-1], flush=True)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
    result = {
        "pairs": pairs,
        "median_ratio": round(statistics.median(p["ratio"] for p in pairs), 3),
        "streams": STREAMS,
        "tokens": args.tokens,
        "server": "tandem serve scripted --worker-threads 1 --max-num-seqs 64",
        "threads": "OMP_NUM_THREADS=1, worker threads 1",
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"median ratio beside/alone {result['median_ratio']}; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
