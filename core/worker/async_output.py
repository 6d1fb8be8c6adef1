"""Async scheduling without a drafter: sampled ids stay on the device between steps.

After sampling, the ids stay on the device as `prev_sampled_token_ids` and the input batch
gets a `-1` placeholder per sampled token. The next step's input ids for those positions
are copied on the device (one slice copy when the batch kept its order, an index scatter
otherwise), so the host never waits for them. The host copy runs on its own CUDA stream,
recorded by an event; `AsyncDeviceModelRunnerOutput.get_output()` waits for it only when
the engine collects the step. `resolve()` replaces the placeholders with the real ids: at
sampling when penalties or bad words need the history, otherwise once the step after has
been sampled (the copy is long finished by then).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

import torch

from tandem.core.model_runner_output import ModelRunnerOutput, SamplerOutput
from tandem.core.outputs import TokenLogprobs
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch
from tandem.core.worker.logprobs import logprobs_per_request


@dataclass(slots=True)
class AsyncDeviceModelRunnerOutput:
    """One step's results before the device-to-host copy is waited on (the worker's
    `AsyncModelRunnerOutput`).

    The worker returns it from `sample_tokens` right after starting the copy of the sampled
    ids (and logprobs) to host memory (on CUDA: on a separate copy stream, `copy_done`
    recorded after it). `get_output()` waits for that copy and builds the
    `ModelRunnerOutput`; the engine calls it when it collects the step, so the worker never
    blocks on the copy before running the next step. Host tensors are never reused, so
    nothing can overwrite them before `get_output()` reads them.
    """

    req_ids: list[str]
    sample_req_indices: list[int]
    num_top_logprobs: list[int | None]
    sampled_token_ids: torch.Tensor  # host [num_sampling_requests, 1], possibly in flight
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    copy_done: torch.cuda.Event | None = None
    failed: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        sampled_rows: list[list[int]] = [[] for _ in self.req_ids]
        for r, token in zip(
            self.sample_req_indices, self.sampled_token_ids[:, 0].tolist(), strict=True
        ):
            sampled_rows[r] = [token]
        logprobs = None
        if self.logprobs is not None:
            logprobs = logprobs_per_request(
                len(self.req_ids),
                self.sample_req_indices,
                [0] * len(self.sample_req_indices),
                self.num_top_logprobs,
                sampled_rows,
                self.logprobs,
            )
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
            sampled_token_ids=sampled_rows,
            logprobs=logprobs,
            failed=self.failed,
            prompt_logprobs=self.prompt_logprobs,
        )


class DeviceOutputs:
    """The last step's sampled ids on the device, and their pending host copy.

    Invariant: a `-1` in the input batch is only ever a row's last token, and its request
    is in `prev_req_id_to_index`: `resolve()` runs before new placeholders are appended,
    so it gets its id from row `prev_req_id_to_index[req_id]` of `prev_sampled_token_ids`.
    A request removed since, or re-added with real tokens, is skipped.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: The last step's sampled ids `[num_sampling_requests, 1]` on the device, and each
        #: request's row in it; the next step's inputs are filled from it on the device.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] = {}
        self._prev_host: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def fill_sampled_inputs(self, batch: FlatBatch) -> None:
        """Write the previous step's sampled ids, still on the device, into this step's
        input ids at `batch.placeholder_positions`."""
        flat = batch.placeholder_positions
        if not flat:
            return
        assert self.prev_sampled_token_ids is not None
        starts = list(itertools.accumulate(batch.num_scheduled_tokens, initial=0))
        prev = self.prev_req_id_to_index
        source = [prev[batch.req_ids[bisect.bisect_right(starts, t) - 1]] for t in flat]
        n = len(flat)
        ids = self.prev_sampled_token_ids[:, 0]
        if flat == list(range(n)) and source == flat:
            batch.input_ids[:n].copy_(ids[:n], non_blocking=True)  # unchanged batch
            return
        device = batch.input_ids.device
        batch.input_ids.index_copy_(
            0,
            host_int64(flat).to(device, non_blocking=True),
            ids.index_select(0, host_int64(source).to(device)),
        )

    def resolve(self, input_batch: InputBatch) -> None:
        """Replace the last step's `-1` placeholders in the input batch with the sampled
        ids, waiting for their host copy."""
        if self._prev_host is None:
            return
        host, copy_done = self._prev_host
        self._prev_host = None
        if copy_done is not None:
            copy_done.synchronize()
        row_of = input_batch.req_id_to_row
        present = [(row_of[r], i) for r, i in self.prev_req_id_to_index.items() if r in row_of]
        if not present:
            return
        rows = host_int64([row for row, _ in present])
        last = input_batch.num_tokens[rows] - 1  # a row holds at least its prompt's tokens
        keep = input_batch.token_ids[rows, last] == -1
        values = host[host_int64([i for _, i in present]), 0]
        if bool(keep.all()):
            input_batch.token_ids[rows, last] = values
        else:
            input_batch.token_ids[rows[keep], last[keep]] = values[keep]

    def keep(
        self,
        batch: FlatBatch,
        input_batch: InputBatch,
        result: SamplerOutput | None,
        num_top: list[int | None],
        failed: dict[str, str],
    ) -> AsyncDeviceModelRunnerOutput:
        """Start the host copy of the step's sampled ids, append `-1` placeholders to the
        sampling rows, and keep the ids on the device for the next step's inputs."""
        self.resolve(input_batch)  # the step before: its copy is long done
        sampled = (
            result.sampled_token_ids[:, :1]
            if result is not None
            else torch.zeros(0, 1, dtype=torch.int64, device=self.device)
        )
        logprobs = result.logprobs if result is not None else None
        copy_done: torch.cuda.Event | None = None
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
                if logprobs is not None:
                    logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs)  # type: ignore[assignment]
                copy_done = torch.cuda.Event()
                copy_done.record(self._copy_stream)
        else:
            host = sampled.to("cpu", copy=True)
        sampling = [batch.req_ids[r] for r in batch.sample_req_indices]
        input_batch.append_placeholders(input_batch.rows_of(sampling))
        self.prev_sampled_token_ids = sampled
        self.prev_req_id_to_index = {req_id: i for i, req_id in enumerate(sampling)}
        self._prev_host = (host, copy_done)
        return AsyncDeviceModelRunnerOutput(
            req_ids=batch.req_ids,
            sample_req_indices=batch.sample_req_indices,
            num_top_logprobs=num_top,
            sampled_token_ids=host,
            logprobs=logprobs,
            copy_done=copy_done,
            failed=failed,
        )
