"""A seeded fuzz of `AsyncLLM` under concurrent clients that choose request ids
adversarially, with the nonce invariant: no request ever receives another request's
tokens, state or finish.

`generate_client_workload(seed)` draws a plain dict: 2-6 clients, each issuing 1-6 requests
one after another. Labels (`request_id`s) come from a small pool on purpose: the same label
in flight in several clients at once, labels shaped like another request's `n > 1`
sequences (`"0_r"` next to `"r"` with `n = 2`), and a label reused right after its stream
was closed mid-request. Each request has a nonce: its prompt starts with two tokens no
other request of the workload has. It runs greedy on the scripted model with `n` in 1..3,
any output kind, `max_tokens`, `min_tokens`, stop tokens or `ignore_eos`, and either runs
to the end or is closed (`aclose`) after a few outputs.

`run_client_workload(engine, workload)` runs the clients concurrently on one `AsyncLLM`
and checks every output as it arrives: its `request_id` is the request's label, its
`prompt_token_ids` the request's own prompt (the nonce), each sequence's tokens a prefix of
the scripted continuation of that prompt, nothing after `finished`, and at the end exactly
that continuation and finish reason for every request not closed early. Then the engine
must go idle with an empty KV pool. A violation raises `ClientFuzzFailure` with the seed
and the workload as a dict.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from tandem.engine import AsyncLLM
from tandem.schema.outputs import RequestOutput
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing import expected_scripted_output

#: A hang is a failure, not a stuck test run.
HANG_S = 120.0
KINDS = {
    "delta": RequestOutputKind.DELTA,
    "cumulative": RequestOutputKind.CUMULATIVE,
    "final": RequestOutputKind.FINAL_ONLY,
}


class ClientFuzzFailure(AssertionError):
    """A workload broke the nonce invariant or left the engine busy."""


def generate_client_workload(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    bases = [rng.choice(["r", "a", "x-1", "0"]) for _ in range(2)]
    pool = [*bases, *(f"{j}_{b}" for b in bases for j in range(3)), "same"]
    clients, nonce = [], 0
    for _ in range(rng.randint(2, 6)):
        requests = []
        for _ in range(rng.randint(1, 6)):
            tail = [rng.randrange(2, 128) for _ in range(rng.randint(0, 6))]
            params: dict[str, Any] = {
                "n": rng.choice([1, 1, 1, 2, 3]),
                "max_tokens": rng.randint(1, 24),
                "kind": rng.choice(list(KINDS)),
                "ignore_eos": rng.random() < 0.3,
            }
            if rng.random() < 0.2:
                params["min_tokens"] = rng.randint(0, params["max_tokens"])
            if rng.random() < 0.2:
                params["stop_token_ids"] = [rng.randrange(2, 128)]
            requests.append(
                {
                    "label": rng.choice(pool),
                    # two nonce tokens (base 120, never EOS) before a random tail
                    "prompt": [2 + nonce % 120, 2 + nonce // 120 % 120, *tail],
                    "params": params,
                    "close_after": rng.choice([None, None, None, 1, 2]),
                }
            )
            nonce += 1
        clients.append(requests)
    return {"seed": seed, "clients": clients}


def _sampling_params(params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        n=params["n"],
        max_tokens=params["max_tokens"],
        min_tokens=params.get("min_tokens", 0),
        stop_token_ids=params.get("stop_token_ids", []),
        ignore_eos=params["ignore_eos"],
        output_kind=KINDS[params["kind"]],
    )


class _Checker:
    """Follows one request's outputs and checks each against the request's own nonce."""

    def __init__(self, engine: AsyncLLM, request: dict[str, Any]) -> None:
        self.request = request
        self.params = _sampling_params(request["params"])
        model = engine.config.model
        self.expected = expected_scripted_output(
            request["prompt"],
            self.params.model_copy(update={"n": 1}),
            model.vocab_size,
            model.eos_token_id,
            engine.max_model_len,
        )
        self.tokens: dict[int, list[int]] = {j: [] for j in range(self.params.n)}
        self.reasons: dict[int, str | None] = {j: None for j in range(self.params.n)}
        self.finished = False

    def fail(self, what: str) -> None:
        raise ClientFuzzFailure(f"request {self.request}: {what}")

    def see(self, out: RequestOutput) -> None:
        if self.finished:
            self.fail(f"an output after the request finished: {out}")
        if out.request_id != self.request["label"]:
            self.fail(f"output labelled {out.request_id!r}")
        if out.prompt_token_ids != self.request["prompt"]:
            self.fail(f"another request's prompt (nonce): {out.prompt_token_ids}")
        if out.error is not None:
            self.fail(f"an error: {out.error}")
        delta = self.params.output_kind == RequestOutputKind.DELTA
        for c in out.outputs:
            if c.index not in self.tokens:
                self.fail(f"a sequence index {c.index} of n={self.params.n}")
            if self.reasons[c.index] is not None and (c.token_ids if delta else False):
                self.fail(f"tokens for sequence {c.index} after its finish")
            seen = self.tokens[c.index] + list(c.token_ids) if delta else list(c.token_ids)
            if seen != self.expected[0][: len(seen)]:
                self.fail(f"sequence {c.index} got {seen}, not a prefix of {self.expected[0]}")
            self.tokens[c.index] = seen
            if c.finish_reason is not None:
                self.reasons[c.index] = c.finish_reason
        self.finished = out.finished

    def check_complete(self) -> None:
        if not self.finished:
            self.fail("the stream ended without a finished output")
        for j in self.tokens:
            if (self.tokens[j], self.reasons[j]) != self.expected:
                self.fail(f"sequence {j}: {(self.tokens[j], self.reasons[j])} != {self.expected}")


async def _run_request(engine: AsyncLLM, request: dict[str, Any]) -> None:
    checker = _Checker(engine, request)
    stream = engine.generate(request["prompt"], checker.params, request["label"])
    close_after = request["close_after"]
    seen = 0
    try:
        async for out in stream:
            checker.see(out)
            seen += 1
            if close_after is not None and seen >= close_after and not out.finished:
                break
    finally:
        await stream.aclose()
    if close_after is None or checker.finished:
        checker.check_complete()


async def _run_client(engine: AsyncLLM, requests: list[dict[str, Any]]) -> None:
    for request in requests:
        await _run_request(engine, request)


async def _idle(engine: AsyncLLM, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        stats = engine.engine_stats()
        if (
            engine.num_unfinished() == 0
            and stats
            and all(
                s["num_running_reqs"] == 0
                and s["num_waiting_reqs"] == 0
                and s["kv_cache_usage"] == 0
                for s in stats
            )
        ):
            return
        await asyncio.sleep(0.01)
    raise ClientFuzzFailure(f"the engine is not idle after the workload: {engine.engine_stats()}")


def run_client_workload(engine: AsyncLLM, workload: dict[str, Any]) -> None:
    """Run and check one workload (see the module docstring); raise `ClientFuzzFailure`."""

    async def main() -> None:
        runs = [_run_client(engine, requests) for requests in workload["clients"]]
        await asyncio.wait_for(asyncio.gather(*runs), HANG_S)
        await _idle(engine, HANG_S)

    try:
        asyncio.run(main())
    except ClientFuzzFailure as exc:
        raise ClientFuzzFailure(f"seed {workload['seed']}: {exc}\nworkload: {workload}") from None
    except TimeoutError:
        raise ClientFuzzFailure(
            f"seed {workload['seed']}: a client hung\nworkload: {workload}"
        ) from None
