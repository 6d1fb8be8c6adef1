"""AsyncLLM over a real engine-core process on the scripted model: streaming parity with
`LLM.generate`, output kinds, n > 1, aborts and disconnects (KV back to free), slow readers,
a full queue, bad input, data parallelism and engine death."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from tandem import LLM
from tandem.engine import AsyncLLM, EngineDeadError, QueueFullError, StreamOverflowError
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)


def prompts(count: int) -> list[list[int]]:
    return [[3 + i % 50, 7 + (i * 13) % 90, 11, 20 + i % 7] for i in range(count)]


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, max_num_seqs=16)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(model="scripted", worker_num_threads=1, max_num_seqs=16)
    outs = llm.generate(prompts(64), SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


async def collect(eng: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in eng.generate(prompt, params, rid)]


async def wait_idle(eng: AsyncLLM, timeout_s: float = 10.0) -> dict:
    """Until an engine reports nothing running or waiting and an empty KV pool."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        stats = eng.engine_stats()
        if stats and all(
            s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0 and s["kv_cache_usage"] == 0
            for s in stats
        ):
            return stats[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle within {timeout_s} s: {eng.engine_stats()}")


def test_64_concurrent_streams_equal_llm_generate(engine, reference) -> None:
    async def main() -> list[list[int]]:
        runs = [collect(engine, p, GREEDY, f"par-{i}") for i, p in enumerate(prompts(64))]
        results = await asyncio.gather(*runs)
        return [[t for out in outs for t in out.outputs[0].token_ids] for outs in results]

    assert asyncio.run(main()) == reference


def test_output_kinds(engine, reference) -> None:
    async def main() -> None:
        p = prompts(1)[0]
        cumulative = SamplingParams(temperature=0, max_tokens=12)
        outs = await collect(engine, p, cumulative, "kind-c")
        assert outs[-1].outputs[0].token_ids == reference[0]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and len(outs) > 1
        final = cumulative.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})
        outs = await collect(engine, p, final, "kind-f")
        assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == reference[0]

    asyncio.run(main())


def test_n_sequences_carry_their_index(engine) -> None:
    async def main() -> None:
        params = SamplingParams(n=3, temperature=0, max_tokens=5)
        outs = await collect(engine, [5, 6, 7], params, "n3")
        last = outs[-1]
        assert last.finished and [c.index for c in last.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 5 for c in last.outputs)
        delta = params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
        seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for out in engine.generate([5, 6, 7], delta, "n3-delta"):
            for c in out.outputs:
                seen[c.index] += c.token_ids
        assert seen == {c.index: c.token_ids for c in last.outputs}

    asyncio.run(main())


def test_half_disconnect_mid_stream_others_complete_and_kv_frees(engine, reference) -> None:
    async def reader(i: int, p: list[int]) -> list[int] | None:
        tokens: list[int] = []
        params = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
        stream = engine.generate(p, params, f"dc-{i}")
        async for out in stream:
            tokens += out.outputs[0].token_ids
            if i % 2 and len(tokens) >= 3:
                await stream.aclose()  # the client goes away mid-stream
                return None
        return tokens

    async def main() -> None:
        results = await asyncio.gather(*[reader(i, p) for i, p in enumerate(prompts(64))])
        for i, tokens in enumerate(results):
            assert tokens == (None if i % 2 else reference[i])
        stats = await wait_idle(engine)
        assert stats["kv_cache_usage"] == 0
        assert engine.num_unfinished() == 0

    asyncio.run(main())


def test_abort_ends_the_stream(engine) -> None:
    async def main() -> None:
        params = SamplingParams(temperature=0, max_tokens=200, output_kind=RequestOutputKind.DELTA)
        stream = engine.generate([1, 2, 3], params, "to-abort")
        await stream.__anext__()
        await engine.abort("to-abort")
        with pytest.raises(asyncio.CancelledError):
            async for _ in stream:
                pass
        await wait_idle(engine)

    asyncio.run(main())


def test_slow_reader_overflows_alone() -> None:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, stream_buffer_size=4)
    try:

        async def main() -> None:
            params = SamplingParams(
                temperature=0, max_tokens=64, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )
            stalled = eng.generate([1, 2, 3], params, "stalled")
            await stalled.__anext__()  # then never reads again while the others run
            # the others ask for one output each, so a lagging event loop on a busy
            # machine cannot overflow their buffers: only the stalled reader's fills up
            final = params.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})
            others = [collect(eng, p, final, f"fast-{i}") for i, p in enumerate(prompts(8))]
            results = await asyncio.gather(*others)
            assert all(len(r) == 1 and len(r[0].outputs[0].token_ids) == 64 for r in results)
            with pytest.raises(StreamOverflowError):
                async for _ in stalled:
                    pass
            await wait_idle(eng)

        asyncio.run(main())
    finally:
        eng.shutdown()


def test_bad_input_raises_before_anything_runs(engine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, [], GREEDY, "empty")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [1] * (engine.max_model_len + 1), GREEDY, "long")
        with pytest.raises(ValueError, match="text prompts need a tokenizer"):
            await collect(engine, "hello", GREEDY, "text")
        assert engine.is_healthy()

    asyncio.run(main())


def test_full_queue_raises_queue_full() -> None:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, max_num_seqs=2, max_num_waiting=1)
    try:

        async def main() -> None:
            params = SamplingParams(temperature=0, max_tokens=50)
            streams = [eng.generate([1, 2, 3], params, f"q-{i}") for i in range(3)]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
            await asyncio.sleep(0)  # the three are admitted: 2 run, 1 waits
            with pytest.raises(QueueFullError) as info:
                await collect(eng, [1, 2, 3], params, "q-over")
            assert info.value.retry_after_s >= 1
            await asyncio.gather(*firsts)
            for s in streams:
                async for _ in s:
                    pass

        asyncio.run(main())
    finally:
        eng.shutdown()


def test_data_parallel_spreads_and_matches(reference) -> None:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, max_num_seqs=16, data_parallel_size=2)
    try:

        async def main() -> list[list[int]]:
            runs = [collect(eng, p, GREEDY, f"dp-{i}") for i, p in enumerate(prompts(64))]
            results = await asyncio.gather(*runs)
            return [[t for o in outs for t in o.outputs[0].token_ids] for outs in results]

        assert asyncio.run(main()) == reference
        served = [s.get("prefix_cache_queries", 0) for s in eng.engine_stats()]
        assert len(served) == 2 and all(q > 0 for q in served)  # both engines took work
    finally:
        eng.shutdown()


ENDLESS = SamplingParams(
    temperature=0, max_tokens=100_000, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def worker_pids(core_pid: int) -> list[int]:
    """The engine core's worker processes: children of its fork server
    (`core/worker/process_start.py`), or its own children when they were spawned."""
    found = []
    for child in child_pids(core_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"forkserver" in cmdline:
            found += child_pids(child)
        elif b"resource_tracker" not in cmdline:
            found.append(child)
    return found


async def kill_mid_stream(eng: AsyncLLM, victim: str, match: str, timeout_s: float) -> None:
    """Start an endless stream, SIGKILL the engine core ("core") or its worker process
    ("worker") once it produced, and expect the stream to fail with `EngineDeadError`."""
    stream = eng.generate([1, 2, 3], ENDLESS, "doomed")
    await stream.__anext__()
    pid = eng.client.processes[0].pid
    if victim == "worker":
        workers = worker_pids(pid)
        assert workers, "the process executor's worker descends from the engine core"
        pid = workers[0]
    os.kill(pid, signal.SIGKILL)

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(EngineDeadError, match=match):
        await asyncio.wait_for(drain(), timeout_s)


def test_engine_death_fails_streams_and_is_noticed() -> None:
    eng = AsyncLLM(model="scripted", worker_num_threads=1)
    try:

        async def main() -> None:
            await kill_mid_stream(eng, "core", "exited unexpectedly", 5)
            reason = await asyncio.wait_for(eng.wait_dead(), 1)
            assert "engine core 0" in reason and not eng.is_healthy()
            with pytest.raises(EngineDeadError):
                await collect(eng, [1, 2], GREEDY, "after")

        asyncio.run(main())
    finally:
        eng.shutdown()


def test_worker_process_death_kills_the_engine_cleanly() -> None:
    eng = AsyncLLM(model="scripted", worker_num_threads=1, executor="process")
    try:

        async def main() -> None:
            await kill_mid_stream(eng, "worker", "worker", 10)
            assert not eng.is_healthy()

        asyncio.run(main())
        eng.client.processes[0].join(timeout=10)
        assert eng.client.processes[0].exitcode == 1  # the engine core exits non-zero
    finally:
        eng.shutdown()
