"""Streaming under load against a live `tandem serve scripted` process: 64 concurrent
greedy streams equal `tandem.LLM.generate` token for token; half of them disconnecting
mid-stream leaves the others exact and the KV pool fully free (read from /metrics); 8
streams started beside a stalled reader stream and finish exactly while it stays blocked
(their latency alone and beside it is measured by benchmarks/stalled_reader.py, not here).

Token ids come from the server's `token_ids` field (returned on a model without a
tokenizer, as vLLM's `return_token_ids`). Clients are `openai.AsyncOpenAI` streams on one
event loop; the stalled reader is a raw socket that sends its request and never reads.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_helpers import (
    HOST,
    ServerProcess,
    metric_values,
    running_server,
    scaled,
    token_ids,
    wait_for,
    wait_idle,
)

from tandem import LLM
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import expected_scripted_output

NUM_CLIENTS = 64
MAX_TOKENS = 16
#: The disconnecting clients' max_tokens: far more than they read before leaving.
LONG = 1000


def prompts(count: int) -> list[list[int]]:
    return [[3 + i % 50, 7 + (i * 13) % 90, 11, 20 + i % 7, 1 + i % 5] for i in range(count)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("scripted", "--max-num-seqs", "64", "--max-model-len", "4096") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """`LLM.generate` (in this process) on the same prompts, greedy, fixed lengths."""
    llm = LLM(model="scripted", worker_num_threads=1, max_num_seqs=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts(NUM_CLIENTS), params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


async def stream_tokens(
    client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, stop_after: int | None = None
) -> tuple[list[int], list[tuple[float, int]]]:
    """Greedy stream of `prompt`: (token ids, (arrival time, tokens) per chunk). With
    `stop_after`, the client closes the response after that many chunks."""
    stream = await client.completions.create(
        model="scripted",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens: list[int] = []
    arrivals: list[tuple[float, int]] = []
    try:
        async for chunk in stream:
            new = [t for c in chunk.choices for t in token_ids(c)]
            tokens += new
            arrivals.append((time.perf_counter(), len(new)))
            if stop_after is not None and len(arrivals) >= stop_after:
                break
    finally:
        await stream.close()
    return tokens, arrivals


def run_clients(server: ServerProcess, jobs: list[tuple[list[int], int, int | None]]) -> list:
    """Run `(prompt, max_tokens, stop_after)` streams concurrently; their results."""

    async def main() -> list:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="none", max_retries=0, timeout=scaled(120)
        ) as client:
            runs = [stream_tokens(client, p, m, s) for p, m, s in jobs]
            return await asyncio.wait_for(asyncio.gather(*runs), timeout=scaled(180))

    return asyncio.run(main())


def test_64_concurrent_streams_equal_llm_generate(server, reference) -> None:
    jobs = [(p, MAX_TOKENS, None) for p in prompts(NUM_CLIENTS)]
    results = run_clients(server, jobs)
    assert [tokens for tokens, _ in results] == reference
    assert all(len(arrivals) >= 2 for _, arrivals in results)  # streamed, not one chunk
    wait_idle(server.url)


def finished(server: ServerProcess, reason: str) -> float:
    label = f'finished_reason="{reason}"'
    return sum(metric_values(server.url, "tandem:request_success_total", label))


def test_half_the_clients_disconnect_mid_stream(server, reference) -> None:
    """Odd clients ask for 1000 tokens and leave after 3 chunks; even clients complete with
    the exact tokens; the KV pool returns to free, and the odd requests count as aborted
    (not run to their length)."""
    aborted, completed = finished(server, "abort"), finished(server, "length")
    jobs = [
        (p, LONG, 3) if i % 2 else (p, MAX_TOKENS, None) for i, p in enumerate(prompts(NUM_CLIENTS))
    ]
    results = run_clients(server, jobs)
    for i, (tokens, _) in enumerate(results):
        if i % 2 == 0:
            assert tokens == reference[i], i
        else:
            assert 0 < len(tokens) < LONG and tokens[:MAX_TOKENS] == reference[i][: len(tokens)]
    wait_idle(server.url)
    half = NUM_CLIENTS // 2
    assert finished(server, "abort") - aborted == half
    assert finished(server, "length") - completed == half


def stalled_request(server: ServerProcess, n: int) -> socket.socket:
    """A streaming request (n sequences x 1000 tokens, 20 logprobs each: ~1.3 kB of events
    per token) on a raw socket with a tiny receive buffer that is never read: the server's
    writes to it block once the socket buffers between them are full."""
    body = json.dumps(
        {
            "model": "scripted",
            "prompt": [1, 2, 3],
            "max_tokens": 1000,
            "n": n,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 20,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((HOST, server.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def run_beside_stalled_reader(server: ServerProcess, jobs: list) -> list:
    """`jobs` while a stalled reader's request (one sequence: its 1000 outputs fit the
    server's per-stream buffer, so it stays blocked and running throughout) is open: it is
    running before they start and still running after they all finished."""
    stalled = stalled_request(server, n=1)
    try:
        wait_for(
            lambda: max(metric_values(server.url, "tandem:num_requests_running")) >= 1,
            scaled(10),
            "the stalled reader's request running",
        )
        results = run_clients(server, jobs)
        assert max(metric_values(server.url, "tandem:num_requests_running")) >= 1
        return results
    finally:
        stalled.close()


def test_a_stalled_reader_does_not_hold_up_the_others(server) -> None:
    """8 greedy streams of 200 tokens started beside a stalled reader all finish, token for
    token, each streamed in several chunks, while the stalled request is still running:
    the server keeps serving the others instead of waiting on the blocked writer."""
    jobs = [(p, 200, None) for p in prompts(8)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    want = [expected_scripted_output(p, params, 128, None, 4096)[0] for p, _, _ in jobs]
    results = run_beside_stalled_reader(server, jobs)
    assert [tokens for tokens, _ in results] == want
    assert all(len(arrivals) >= 2 for _, arrivals in results)  # streamed, not one burst
    wait_idle(server.url, timeout_s=30)


def read_all(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """What the server sent on `sock` until it sent `data: [DONE]` or closed (within
    `scaled(timeout_s)`)."""
    data, deadline = b"", time.monotonic() + scaled(timeout_s)
    sock.settimeout(2)
    while b"data: [DONE]" not in data[-64:] and time.monotonic() < deadline:
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    return data


def test_a_stalled_reader_is_aborted_when_its_buffer_fills(server) -> None:
    """A stalled reader of 8 x 1000 tokens (~10 MB of events; the server buffers 1024
    outputs per stream): its sequences are aborted and the KV pool frees while the client
    still holds the connection open; reading it at last, the client finds an error event
    naming the overflow, then `[DONE]`."""
    aborted = finished(server, "abort")
    stalled = stalled_request(server, n=8)
    try:
        wait_for(
            lambda: finished(server, "abort") - aborted >= 8,
            scaled(30),
            "the stalled stream aborted",
        )
        wait_idle(server.url)
        data = read_all(stalled)
    finally:
        stalled.close()
    assert b"data: [DONE]" in data[-64:], data[-300:]
    events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert error["type"] == "StreamOverflowError" and "behind" in error["message"], error


def test_a_non_streaming_client_that_leaves_aborts_its_request(server) -> None:
    """A non-streaming request for 4000 tokens whose client gives up after 0.3 s: the
    request is aborted (not run to its length) and the KV pool frees."""
    aborted, completed = finished(server, "abort"), finished(server, "length")
    body = {"model": "scripted", "prompt": [2, 4, 6], "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    wait_for(
        lambda: finished(server, "abort") - aborted >= 1, scaled(15), "the left request aborted"
    )
    wait_idle(server.url)
    assert finished(server, "length") == completed
