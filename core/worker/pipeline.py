"""What crosses between pipeline stages: hidden states forward, sampled token ids back.

Stage s holds a contiguous run of decoder layers (`stage_layers`). Per step with tokens:
stage s > 0 receives the `[T, hidden]` residual stream from stage s - 1 (same tensor-parallel
rank) before its first layer, and every stage but the last sends its residual stream on
after its last layer. Only the last stage has logits, samples and drafts; it sends each
step's sampled ids to every earlier stage in one int64 message per step, a row per sampling
request (`pack_sampled`): the accepted ids `[1 + k]` (`-1`-padded), and with a drafter
(k = `num_spec_tokens` > 0) the drafter's next proposal `[k]` (`-1`-padded) and a column
saying whether the request has a new proposal; then one column flagging a failed sampling.
An earlier stage adopts those proposals as its own (`DraftStore.proposals`), so the drafts
it embeds in the next step are the ones the last stage verifies: the drafter runs once,
on the last stage, and its proposals reach the scheduler (the engine's output) and the
earlier stages (this message) from there.

Sends are non-blocking (`isend`), so a stage never waits for the next one to be ready; an
earlier stage posts its receive of a step's sampled ids when the engine asks it to sample
that step, and waits for them only when a later step needs them: with the decode stagger
(`scheduler.decode_stagger` = pp_size), a request sampled in step S is not decoded again
before step S + pp_size, so stage 0 runs step S + 1 while the last stage still runs S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch
from tandem.core.worker.parallel_state import RankInfo

_HIDDEN_TAG = 1
_SAMPLED_TAG = 2


def stage_layers(
    num_layers: int, pp_size: int, pp_rank: int, partition: list[int] | None = None
) -> range:
    """The layers of stage `pp_rank`: `partition[s]` layers for stage s when given (it
    must sum to `num_layers`), else an even split with the remainder on the earliest
    stages (the last stage also runs the final norm and the LM head)."""
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base + (1 if s < extra else 0) for s in range(pp_size)]
    if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"parallel.pp_layer_partition: {partition} must have pipeline_parallel_size "
            f"({pp_size}) entries of at least 1 layer summing to the model's {num_layers} layers"
        )
    start = sum(partition[:pp_rank])
    return range(start, start + partition[pp_rank])


class PipelineLink:
    """This rank's neighbours: the same tensor-parallel rank one stage up and one down."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.is_first = info.pp_rank == 0
        self.is_last = info.pp_rank == info.pp_size - 1
        self.prev_rank = info.rank - info.tp_size
        self.next_rank = info.rank + info.tp_size
        #: Sends in flight with their buffers (a buffer must outlive its send).
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._isend(hidden, self.next_rank, _HIDDEN_TAG)

    def recv_hidden(self, like: torch.Tensor) -> torch.Tensor:
        """The previous stage's residual stream, shaped and typed as `like`."""
        buffer = torch.empty_like(like)
        dist.recv(buffer, self.prev_rank, tag=_HIDDEN_TAG)
        return buffer

    def send_sampled(self, sampled: torch.Tensor) -> None:
        """Last stage: a step's sampled ids (int64, host) to every earlier stage."""
        for stage in range(self.info.pp_size - 1):
            self._isend(sampled, stage * self.info.tp_size + self.info.tp_rank, _SAMPLED_TAG)

    def post_recv_sampled(self, rows: int, width: int) -> tuple[dist.Work, torch.Tensor]:
        """Earlier stage: receive a step's `[rows, width]` sampled ids from the last stage
        (wait on the returned work before reading the tensor)."""
        buffer = torch.empty((rows, width), dtype=torch.int64)
        last = (self.info.pp_size - 1) * self.info.tp_size + self.info.tp_rank
        return dist.irecv(buffer, last, tag=_SAMPLED_TAG), buffer

    def drain_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []


def sampled_width(num_spec_tokens: int) -> int:
    """Columns of the per-step message for drafts of up to `num_spec_tokens` (`pack_sampled`)."""
    k = num_spec_tokens
    return 2 if k == 0 else (1 + k) + k + 1 + 1


def pack_sampled(
    sampled: torch.Tensor,
    failed_rows: list[int],
    num_spec_tokens: int,
    proposals: list[list[int] | None] | None = None,
) -> torch.Tensor:
    """The message for one step (host int64, `[R, sampled_width(k)]`): row i holds the
    request's accepted ids (`sampled[i]`, padded to `1 + k` with -1), then with k > 0 its
    new proposal (`proposals[i]`, padded to k; None: no new proposal) and a has-proposal
    column, then 1 when its sampling failed."""
    k = num_spec_tokens
    rows = sampled.shape[0]
    out = torch.full((rows, sampled_width(k)), -1, dtype=torch.int64)
    out[:, : sampled.shape[1]] = sampled.cpu()
    out[:, -1] = 0
    out[failed_rows, -1] = 1
    if k:
        out[:, -2] = 0
        for i, proposal in enumerate(proposals or ()):
            if proposal is not None:
                out[i, 1 + k : 1 + k + len(proposal)] = torch.tensor(proposal, dtype=torch.int64)
                out[i, -2] = 1
    return out


@dataclass(slots=True)
class AwaitedStep:
    """A step an earlier stage ran whose sampled ids (from the last stage) it has not
    applied yet: the batch, its sampling requests, and the posted receive (None when the
    step sampled nothing)."""

    step_id: int
    batch: FlatBatch
    sampling: list[str]
    work: tuple[dist.Work, torch.Tensor] | None
    num_spec_tokens: int = 0

    def apply(self, input_batch: InputBatch, proposals: dict[str, list[int]]) -> None:
        """Wait for the message and append the ids to the rows of the requests still in the
        batch (one finished or preempted since has left it), as the last stage did; their
        new proposals replace theirs in `proposals`."""
        if self.work is None:
            return
        work, received = self.work
        work.wait()
        row_of = input_batch.req_id_to_row
        keep = [i for i, r in enumerate(self.sampling) if r in row_of]
        if not keep:
            return
        index = host_int64(keep)
        drafts = host_int64(self.batch.num_draft_tokens)
        k = self.num_spec_tokens
        input_batch.append_sampled(
            input_batch.rows_of([self.sampling[i] for i in keep]),
            received[index, : 1 + k],
            drafts[index] if drafts.numel() else drafts,
        )
        if k:
            for i in keep:
                if received[i, -2]:
                    row = received[i, 1 + k : 1 + 2 * k]
                    proposals[self.sampling[i]] = row[row >= 0].tolist()
