"""`tandem bench serve`: a load generator for any OpenAI-compatible server.

    tandem bench serve --base-url http://127.0.0.1:8000/v1 --workload serve \\
        --request-rates 1,2,4,inf --out results.json --png latency.png
    tandem bench serve plot a.json b.json --png out.png

At each request rate the requests of a workload file (`{"name", "requests": [{"prompt_token_ids"
| "prompt", "max_tokens"}]}`, as `tandem.bench` reads them) arrive as a seeded Poisson process
(exponential inter-arrival times); `inf` sends them all at once. Every request is a streaming
`/v1/completions` call (token-id prompts as the `prompt` token list, greedy, `ignore_eos: true`,
`stream_options.include_usage`), so `tandem serve` and `vllm serve` see identical requests.

The client is `httpx.AsyncClient` reading the SSE stream line by line: each `data:` event is
stamped with `time.perf_counter()` the moment it is read, nothing retries behind our back (the
`openai` client retries twice by default, which would hide failures inside latencies), and no
response objects are built per chunk. Per request: TTFT (send to the first chunk with a
choice), ITL (gaps between chunks with a choice), TPOT ((E2E - TTFT) / (output tokens - 1)),
E2E (send to `[DONE]`), output tokens from the usage chunk. A chunk counts by its choice, not its
text, as in vLLM's `benchmark_serving`: a token-only model streams empty texts. Bounded: each request has a timeout and
the whole run a deadline; requests cut off by either count as failed, with the reason. Exit
status: 0 when every request completed, 1 when any failed or the server could not be used.

Every rate gets prompts no earlier request computed: rate i sends each prompt rotated by
i + 1 positions (the same tokens or words, the same length, a different first block), so a
server's prefix cache cannot serve a later rate from an earlier one (or from the warm-up,
which sends the prompts as they are). `--same-prompts-per-rate` sends them unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench_serve_report import plot_main, plot_results, print_summary, summarize_rate

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: a token-id list or a text prompt, and its output length."""

    prompt: list[int] | str
    max_tokens: int


@dataclass
class RequestResult:
    """What one streamed request measured (seconds; `ttft`/`e2e` are None when it failed)."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_missing: bool = False

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None below two tokens."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def load_requests(spec: str, num_requests: int | None) -> tuple[str, list[RequestSpec]]:
    """The workload's name and `num_requests` requests (the file's, cycled or cut; all of them
    when None). `spec` is a file, a built-in name of `tandem.bench`, or the name of a file in
    the checkout's benchmarks/workloads/."""
    from tandem.bench import load_workload

    local = ROOT / "benchmarks" / "workloads" / f"{spec}.json"
    workload = load_workload(str(local) if not Path(spec).exists() and local.exists() else spec)
    entries = workload["requests"]
    if not entries:
        raise ValueError(f"--workload {spec}: no requests")
    count = len(entries) if num_requests is None else num_requests
    specs = []
    for i in range(count):
        r = entries[i % len(entries)]
        prompt = r["prompt_token_ids"] if r.get("prompt_token_ids") else r["prompt"]
        specs.append(RequestSpec(prompt=prompt, max_tokens=int(r["max_tokens"])))
    return str(workload.get("name", spec)), specs


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of `count` requests arriving as a Poisson process of
    `rate` requests/s: cumulative sums of exponential gaps, the first request at 0. An infinite
    rate is a burst (all at 0). Deterministic for a given seed."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def parse_rates(text: str) -> list[float]:
    """`1,2,4,inf` -> [1.0, 2.0, 4.0, inf]."""
    return [float(part) for part in text.split(",") if part.strip()]


def _event_data(line: str) -> str | None:
    return line[5:].strip() if line.startswith("data:") else None


async def stream_completion(client: Any, url: str, payload: dict[str, Any]) -> RequestResult:
    """POST one streaming completion and time its SSE events. Never raises (but for
    cancellation): a non-200 status, an error event, a broken or unfinished stream, or a
    timeout makes a failed result naming the cause."""
    import httpx

    result = RequestResult()
    start = time.perf_counter()
    last_token = None
    deltas = 0
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = _event_data(line)
                if data is None or not data:
                    continue
                now = time.perf_counter()
                if data == "[DONE]":
                    result.ok = True
                    result.e2e = now - start
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                if chunk.get("choices"):  # a delta (as vLLM's bench: text may be empty)
                    deltas += 1
                    if last_token is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last_token)
                    last_token = now
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.prompt_tokens = usage.get("prompt_tokens")
    except httpx.TimeoutException as exc:
        result.error = f"timeout: {type(exc).__name__}"
        return result
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:  # bad JSON too
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if not result.ok:
        result.error = "stream ended without [DONE]"
    elif result.prompt_tokens is None and result.output_tokens == 0:
        result.usage_missing = True  # a server that ignores include_usage: count the deltas
        result.output_tokens = deltas
    if result.ok and result.ttft is None:
        result.ttft = result.e2e  # no delta at all before [DONE]
    return result


def rotated_prompt(prompt: Any, shift: int) -> Any:
    """`prompt` (token ids, or text split on spaces) rotated left by `shift` positions."""
    items = prompt.split(" ") if isinstance(prompt, str) else list(prompt)
    if not items:
        return prompt
    shift %= len(items)
    items = items[shift:] + items[:shift]
    return " ".join(items) if isinstance(prompt, str) else items


def _payload(model: str, spec: RequestSpec, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **extra,
    }


async def run_rate(
    client: Any,
    url: str,
    payloads: list[dict[str, Any]],
    offsets: list[float],
    max_concurrency: int | None,
    time_left: float,
) -> tuple[list[RequestResult], float]:
    """Send `payloads[i]` at `offsets[i]` (at most `max_concurrency` in flight; a request
    waiting for a slot starts its clock when it is sent). Returns the results in workload
    order and the duration (start to the last request's end). Requests still running after
    `time_left` seconds are cancelled and count as failed."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(payload: dict[str, Any], offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        if gate is None:
            return await stream_completion(client, url, payload)
        async with gate:
            return await stream_completion(client, url, payload)

    tasks = [asyncio.create_task(one(p, o)) for p, o in zip(payloads, offsets, strict=True)]
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, time_left))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    results = [
        t.result() if t in done else RequestResult(error="cut off by the run deadline")
        for t in tasks
    ]
    return results, duration


async def first_model(client: Any, base_url: str) -> str:
    """The id of the first model `GET /v1/models` lists."""
    response = await client.get(f"{base_url}/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model")
    return str(models[0]["id"])


@dataclass
class SweepConfig:
    """Everything one sweep needs (see `main`'s flags)."""

    base_url: str
    workload: str
    request_rates: list[float]
    model: str | None = None
    api_key: str | None = None
    num_requests: int | None = None
    max_concurrency: int | None = None
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    request_timeout_s: float = 600.0
    deadline_s: float = 3600.0
    label: str | None = None
    warmup: int = 1
    extra_body: dict[str, Any] = field(default_factory=dict)
    fresh_prompts_per_rate: bool = True


def _client(config: SweepConfig, connections: int) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(config.request_timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,  # 127.0.0.1 must never go through a proxy from the environment
    )


async def run_sweep(config: SweepConfig) -> dict[str, Any]:
    """Warm up, then one run per request rate (each over the same requests, in order);
    returns the results document (`rates`: one summary per rate, see `summarize_rate`)."""
    base = config.base_url.rstrip("/")
    name, specs = load_requests(config.workload, config.num_requests)
    deadline = time.perf_counter() + config.deadline_s
    connections = max(1, min(len(specs), config.max_concurrency or len(specs)))
    async with _client(config, connections) as client:
        model = config.model or await first_model(client, base)
        url = f"{base}/completions"
        payloads = [_payload(model, s, config.extra_body) for s in specs]
        for i in range(config.warmup):
            warm = dict(payloads[i % len(payloads)], max_tokens=4)
            result = await stream_completion(client, url, warm)
            if not result.ok:
                raise RuntimeError(f"warm-up request failed: {result.error}")
        rates = []
        for index, rate in enumerate(config.request_rates):
            offsets = arrival_offsets(len(payloads), rate, config.seed + index)
            time_left = deadline - time.perf_counter()
            sent = payloads
            if config.fresh_prompts_per_rate:
                sent = [dict(p, prompt=rotated_prompt(p["prompt"], index + 1)) for p in payloads]
            results, duration = await run_rate(
                client, url, sent, offsets, config.max_concurrency, time_left
            )
            rates.append(
                summarize_rate(rate, results, duration, config.slo_ttft_ms, config.slo_tpot_ms)
            )
    return {
        "label": config.label or model,
        "base_url": base,
        "model": model,
        "workload": name,
        "num_requests": len(specs),
        "max_concurrency": config.max_concurrency,
        "seed": config.seed,
        "slo": {"ttft_ms": config.slo_ttft_ms, "tpot_ms": config.slo_tpot_ms},
        "client": f"httpx {__import__('httpx').__version__}, SSE line timestamps",
        "load_average": list(os.getloadavg()),
        "rates": rates,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--workload", default="small", help="workload file or name (default: small)")
    p.add_argument("--request-rates", default="1,2,4,inf", help="requests/s, comma list")
    p.add_argument("--num-requests", type=int, help="per rate (default: the workload's)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before the sweep")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument(
        "--same-prompts-per-rate",
        action="store_true",
        help="send every rate the same prompts (default: rotated per rate, so no rate hits "
        "the prefix cache an earlier one filled)",
    )
    p.add_argument("--label", help="name of this run in plots (default: the model)")
    p.add_argument("--out", help="results JSON (default: bench-serve-<label>.json)")
    p.add_argument("--png", help="latency-percentiles plot to write")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench serve` (and `... serve plot FILES --png OUT`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    args = _parser().parse_args(argv)
    config = SweepConfig(
        base_url=args.base_url,
        workload=args.workload,
        request_rates=parse_rates(args.request_rates),
        model=args.model,
        api_key=args.api_key,
        num_requests=args.num_requests,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        request_timeout_s=args.request_timeout,
        deadline_s=args.deadline,
        label=args.label,
        warmup=args.warmup,
        extra_body=json.loads(args.extra_body),
        fresh_prompts_per_rate=not args.same_prompts_per_rate,
    )
    try:
        results = asyncio.run(run_sweep(config))
    except Exception as exc:  # server down, no model, failed warm-up: say so, exit 1
        print(f"tandem bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out or f"bench-serve-{results['label'].replace('/', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"tandem bench serve: wrote {out.resolve()}", file=sys.stderr)
    if args.png:
        plot_results([results], Path(args.png), title=f"{results['workload']} workload")
    print_summary(results)
    return 0 if all(r["failed"] == 0 for r in results["rates"]) else 1


if __name__ == "__main__":
    sys.exit(main())
