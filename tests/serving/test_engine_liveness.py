"""Engine-core liveness and restarts in `AsyncLLM`: a frozen engine core (SIGSTOP) turns
`is_healthy()` False through the missing heartbeat and back once it runs again; a killed
one is restarted with the same configuration (requests in flight fail, later ones are
served) up to `max_engine_restarts`, after which the death is final.

Every wait is bounded; none asserts how long anything took."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tandem.engine import AsyncLLM, EngineDeadError
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing import expected_scripted_output

WAIT_S = 120.0
PROMPT = [5, 9, 11, 20]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


async def until(predicate, what: str, timeout_s: float = WAIT_S) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)


async def tokens_of(engine: AsyncLLM, rid: str, max_tokens: int) -> list[int]:
    async def collect() -> list[int]:
        out: list[int] = []
        async for o in engine.generate(PROMPT, greedy(max_tokens), rid):
            out += o.outputs[0].token_ids
        return out

    return await asyncio.wait_for(collect(), WAIT_S)


def expected(engine: AsyncLLM, max_tokens: int) -> list[int]:
    model = engine.config.model
    return expected_scripted_output(
        PROMPT, greedy(max_tokens), model.vocab_size, model.eos_token_id, engine.max_model_len
    )[0]


def test_a_frozen_engine_core_is_unhealthy_until_it_runs_again() -> None:
    engine = AsyncLLM(model="scripted", worker_num_threads=1, heartbeat_timeout_s=2.0)
    pid = engine.client.processes[0].pid

    async def main() -> None:
        await until(engine.is_healthy, "healthy after start")
        os.kill(pid, signal.SIGSTOP)
        try:
            await until(lambda: not engine.is_healthy(), "unhealthy while frozen")
            assert "no heartbeat" in engine.health_problem()
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(engine.is_healthy, "healthy again after SIGCONT")
        assert await tokens_of(engine, "after", 5) == expected(engine, 5)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_a_killed_engine_core_is_restarted_until_the_bound() -> None:
    engine = AsyncLLM(model="scripted", worker_num_threads=1, max_engine_restarts=2)

    async def kill_mid_request(rid: str) -> None:
        stream = engine.generate(PROMPT, greedy(100_000 // 1000), rid)
        first = await asyncio.wait_for(anext(stream), WAIT_S)
        assert first.outputs[0].token_ids
        os.kill(engine.client.processes[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine core 0"):
            await asyncio.wait_for(_drain(stream), WAIT_S)

    async def main() -> None:
        for restart in (1, 2):
            await kill_mid_request(f"doomed-{restart}")
            # a request sent at once waits for the new engine core and is served
            assert await tokens_of(engine, f"next-{restart}", 6) == expected(engine, 6)
            assert engine.restarts == restart and engine.is_healthy()
            assert engine.num_unfinished() == 0
        await kill_mid_request("doomed-3")
        reason = await asyncio.wait_for(engine.wait_dead(), WAIT_S)
        assert "engine core 0" in reason and engine.restarts == 2
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await tokens_of(engine, "too-late", 2)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


class _FailingSocket:
    """The client's output socket, except that `poll` raises what no ZMQ socket would."""

    def __init__(self, socket: object) -> None:
        self._socket = socket

    def poll(self, *args: object, **kwargs: object) -> int:
        raise RuntimeError("reader state lost")

    def __getattr__(self, name: str) -> object:
        return getattr(self._socket, name)


def test_a_failed_reader_fails_the_streams_and_restarts_the_engine() -> None:
    """A reader thread that dies of an unexpected error must not leave streams waiting for
    outputs that will never be delivered: it reports every engine core dead."""
    engine = AsyncLLM(model="scripted", worker_num_threads=1, max_engine_restarts=1)

    async def main() -> None:
        long = engine.max_model_len - len(PROMPT)
        stream = engine.generate(PROMPT, greedy(long), "doomed")
        first = await asyncio.wait_for(anext(stream), WAIT_S)
        assert first.outputs[0].token_ids
        engine.client.output = _FailingSocket(engine.client.output)
        with pytest.raises(EngineDeadError, match="reader"):
            await asyncio.wait_for(_drain(stream), WAIT_S)
        assert await tokens_of(engine, "next", 6) == expected(engine, 6)
        assert engine.restarts == 1 and engine.is_healthy()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


async def _drain(stream) -> None:  # noqa: ANN001
    async for _ in stream:
        pass


def test_restart_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_engine_restarts"):
        AsyncLLM(model="scripted", max_engine_restarts=-1)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        AsyncLLM(model="scripted", heartbeat_timeout_s=0)
