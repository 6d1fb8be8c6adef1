"""What completions and chat share: model names, prompts, ids, and merging the streams
of several prompts.

`run_blocking(fn, ...)` runs CPU work a request brings (tokenising a prompt, rendering a
chat template, tokenising bad words, parsing a large body) on a small pool of worker
threads, so the event loop keeps answering `/health` and other requests meanwhile; every
such piece of work is bounded (`limits.py`, `template_guard.py`), so a pool thread is never
held for long.

`OutputMerger` runs one `AsyncLLM.generate` per prompt and yields `(prompt index, output)`
as outputs arrive. `start()` lets every generator run up to its first wait, so a request
the engine refuses (bad prompt, full queue, dead engine) fails there, before a response
has started; `close()` cancels what is left (each generator then aborts its request in the
engine) without waiting inside the caller's possibly cancelled scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tandem.request_builder import resolve_bad_words
from tandem.schema.outputs import RequestOutput
from tandem.schema.sampling_params import SamplingParams
from tandem.server.errors import APIError, bad_request

#: Cleanup tasks in flight (a reference keeps them from being garbage collected).
_cleanups: set[asyncio.Task] = set()

T = TypeVar("T")

#: Worker threads for request preprocessing. Two: more would only contend for the GIL
#: with the event loop (heavy requests queue here instead of slowing every response).
PREPROCESS_THREADS = 2
_pool: ThreadPoolExecutor | None = None


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the preprocessing pool, awaited without blocking the loop."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="tandem-preprocess")
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(requested: str | None, served: Sequence[str]) -> str:
    """The served name to answer with; 404 for a name this server does not serve."""
    if requested is None or requested in served:
        return requested or served[0]
    raise APIError(
        404, f"The model `{requested}` does not exist.", err_type="NotFoundError", param="model"
    )


@dataclass(slots=True)
class Prompt:
    """One prompt as the engine takes it: its text (None for token ids) and token ids."""

    text: str | None
    token_ids: list[int]

    def as_engine_prompt(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def tokenize(tokenizer: Any, text: str, add_special_tokens: bool, where: str) -> Prompt:
    """A text prompt through the model's tokenizer; 400 naming `where` without one."""
    if tokenizer is None:
        raise bad_request(
            f"{where}: text prompts need a tokenizer; this model has none, pass token ids",
            param=where,
        )
    ids = list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    if not ids:
        raise bad_request(f"{where}: the prompt is empty (no tokens)", param=where)
    return Prompt(text, ids)


def prompt_len(prompt: Prompt, truncate: int | None, max_model_len: int) -> int:
    """The prompt's length in the engine, after `truncate_prompt_tokens`."""
    n = len(prompt.token_ids)
    if truncate is None:
        return n
    return min(n, max_model_len - 1 if truncate == -1 else truncate)


class OutputMerger:
    """Yields `(i, output)` from `gens[i]` as they come (vLLM's merge_async_iterators)."""

    def __init__(self, gens: Sequence[AsyncIterator[RequestOutput]]) -> None:
        self.gens = list(gens)
        self.tasks: dict[asyncio.Future, int] = {}

    async def start(self) -> None:
        """Run each generator to its first wait; raise the first refusal (closing all)."""
        for i, gen in enumerate(self.gens):
            self.tasks[asyncio.ensure_future(gen.__anext__())] = i
        await asyncio.sleep(0)
        for task in self.tasks:
            if task.done() and not task.cancelled():
                exc = task.exception()
                if exc is not None and not isinstance(exc, StopAsyncIteration):
                    self.close()
                    raise exc

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.gens) == 1:  # one prompt (the common case): no task per output
            async for output in self._single():
                yield 0, output
            return
        while self.tasks:
            done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = self.tasks.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                self.tasks[asyncio.ensure_future(self.gens[i].__anext__())] = i
                yield i, output

    async def _single(self) -> AsyncIterator[RequestOutput]:
        if not self.tasks:
            return
        (first,) = self.tasks
        try:
            output = await first
        except StopAsyncIteration:
            return
        finally:
            self.tasks = {}
        yield output
        async for output in self.gens[0]:
            yield output

    def close(self) -> None:
        """Cancel the pending reads and close the generators (each aborts its request)."""
        tasks, self.tasks = list(self.tasks), {}
        for task in tasks:
            task.cancel()
        cleanup = asyncio.ensure_future(_close_all(tasks, self.gens))
        _cleanups.add(cleanup)
        cleanup.add_done_callback(_cleanups.discard)


async def _close_all(tasks: list[asyncio.Future], gens: list[Any]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    for gen in gens:
        with contextlib.suppress(Exception):  # a generator that failed has nothing to free
            await gen.aclose()


async def run_cancellable(receive: Any, work: Any, stop: asyncio.Future | None = None) -> Any:
    """Await the coroutine `work`, cancelling it when the client disconnects (an
    `http.disconnect` from ASGI `receive`, read after the body) or when `stop` completes
    first (the server's shutdown grace period ended: `drain.shutdown_error()` is raised).
    Returns its result; None when the client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    waits = {task, watcher} if stop is None else {task, watcher, stop}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished = task.done()
        if not finished:
            task.cancel()
        watcher.cancel()
        stopped = stop is not None and stop.done() and not stop.cancelled()
        if stop is not None:
            stop.cancel()
    if finished:
        return None if task.cancelled() else task.result()
    if stopped:
        from tandem.server.drain import shutdown_error

        raise shutdown_error()
    return None


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def with_bad_words(engine: Any, params: SamplingParams) -> SamplingParams:
    """`params` with its `bad_words` tokenised (`resolve_bad_words`) on the preprocessing
    pool; unchanged without bad words or without a tokenizer (the engine refuses those)."""
    if not params.bad_words or engine.tokenizer is None:
        return params
    return await run_blocking(resolve_bad_words, engine.tokenizer, params)


async def with_bad_words_each(engine: Any, params: list[SamplingParams]) -> list[SamplingParams]:
    """`with_bad_words` for the parameters of a batch of prompts (the same words each:
    they are tokenised once)."""
    if not params or not params[0].bad_words:
        return params
    first = await with_bad_words(engine, params[0])
    update = {"bad_words": first.bad_words, "bad_words_token_ids": first.bad_words_token_ids}
    return [first, *(p.model_copy(update=update) for p in params[1:])]
