"""Building the sampler's inputs for a step: `SamplingMetadata` and the grammar rows.

Every sampling request owns `1 + drafts` consecutive logits rows (row j samples the token
after its first j drafts). Per-row parameters are gathered from the persistent
`InputBatch` with one index tensor; Python work is per request and only for the requests
that need it (blocked tokens, sparse parameters, penalty histories).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch, RequestState
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.schema.sampling_params import num_logprobs


def blocked_tokens(
    state: RequestState, token_ids: Sequence[int], drafts: Sequence[int] = ()
) -> list[int]:
    """Tokens the row after `token_ids` (the request's prompt and outputs) followed by
    `drafts` must not produce: EOS and stop tokens before `min_tokens`, and the last token
    of each bad word whose other tokens end the output history (outputs, then `drafts`;
    the prompt does not count, as in vLLM)."""
    params = state.sampling_params
    blocked: list[int] = []
    if len(token_ids) - state.num_prompt_tokens + len(drafts) < params.min_tokens:
        if not params.ignore_eos and state.eos_token_id is not None:
            blocked.append(state.eos_token_id)
        blocked.extend(params.stop_token_ids)
    if state.bad_words is not None:
        # only the last `longest_prefix` tokens of the outputs and drafts can match
        start = max(state.num_prompt_tokens, len(token_ids) - state.bad_words.longest_prefix)
        blocked += state.bad_words.blocked([*token_ids[start:], *drafts])
    return blocked


def sparse_rows(
    spans: list[tuple[str, int, int]],
    per_request: dict[str, tuple[torch.Tensor, torch.Tensor]] | dict[str, torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids[, values]) for per-request sparse parameters: each request's
    tensors repeated over its `count` consecutive rows starting at `first`."""
    if not spans:
        return None
    parts: list[list[torch.Tensor]] = []
    for req_id, first, count in spans:
        value = per_request[req_id]
        tensors = value if isinstance(value, tuple) else (value,)
        width = tensors[0].shape[0]
        rows = torch.arange(first, first + count, dtype=torch.int64).repeat_interleave(width)
        parts.append([rows, *(t.repeat(count) for t in tensors)])
    return tuple(torch.cat(column).to(device) for column in zip(*parts, strict=True))


def needs_history(input_batch: InputBatch, req_ids: list[str]) -> bool:
    """Whether penalties or bad words of these requests read their token histories."""
    if not input_batch.penalized and not input_batch.blocking:
        return False
    states = input_batch.states
    return any(
        r in input_batch.penalized or bool(states[r].sampling_params.bad_words_token_ids)
        for r in req_ids
    )


def build_sampling_metadata(
    input_batch: InputBatch,
    batch: FlatBatch,
    grammar_bitmask: torch.Tensor | None,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Per logits row of `batch`'s sampling requests: the parameters of its request's
    input-batch row, its output position, its blocked tokens and, when penalties need
    them, its history (outputs, then the drafts before it). Histories must hold real ids
    (the runner resolves async placeholders first)."""
    ib = input_batch
    req_ids = [batch.req_ids[r] for r in batch.sample_req_indices]
    states = [ib.states[r] for r in req_ids]
    rows = ib.rows_of(req_ids)
    num_output = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
    ks = batch.num_draft_tokens
    if batch.draft_token_ids:
        per_request = host_int64(ks) + 1
        num_rows = int(per_request.sum())
        firsts = torch.repeat_interleave(torch.cumsum(per_request, 0) - per_request, per_request)
        index = torch.repeat_interleave(rows, per_request, output_size=num_rows)
        positions = torch.repeat_interleave(num_output, per_request, output_size=num_rows)
        positions += torch.arange(num_rows, dtype=torch.int64) - firsts
    else:
        index, positions = rows, num_output
    asked = [
        num_logprobs(s.sampling_params.logprobs, vocab_size)
        for s in states
        if s.sampling_params.logprobs is not None
    ]
    temperature = ib.temperature[index]
    drafts = _drafts_per_request(batch)
    blocked = _blocked_rows(ib, req_ids, ks, drafts)
    penalties = _penalty_inputs(ib, req_ids, ks, drafts, index)
    return SamplingMetadata(
        all_greedy=bool((temperature == 0).all()),
        temperature=temperature.to(device),
        top_k=ib.top_k[index].to(device),
        top_p=ib.top_p[index].to(device),
        min_p=ib.min_p[index].to(device),
        seeds=ib.seeds[index].to(device),
        seeded=ib.seeded[index].to(device),
        logit_bias=sparse_rows(_spans(ib.logit_bias, req_ids, ks), ib.logit_bias, device),
        allowed_token_ids=sparse_rows(
            _spans(ib.allowed_token_ids, req_ids, ks), ib.allowed_token_ids, device
        ),
        output_positions=positions.to(device),
        num_draft_tokens=ks,
        draft_token_ids=host_int64(batch.draft_token_ids).to(device),
        output_token_ids=penalties[0] if penalties else None,
        prompt_token_ids=penalties[1] if penalties else None,
        penalties=penalties[2] if penalties else None,
        grammar_bitmask=grammar_bitmask,
        max_num_logprobs=max(asked) if asked else None,  # type: ignore[type-var]
        blocked_tokens=(
            host_int64(blocked[0]).to(device),
            host_int64(blocked[1]).to(device),
        )
        if blocked[0]
        else None,
    )


def _drafts_per_request(batch: FlatBatch) -> list[list[int]]:
    drafts, end = [], 0
    for k in batch.num_draft_tokens:
        drafts.append(batch.draft_token_ids[end : end + k])
        end += k
    return drafts


def _first_rows(ks: list[int]) -> list[int]:
    firsts, row = [], 0
    for k in ks:
        firsts.append(row)
        row += k + 1
    return firsts


def _spans(
    per_request: dict[str, object], req_ids: list[str], ks: list[int]
) -> list[tuple[str, int, int]]:
    """(req id, first row, rows) of the sampling requests that have a sparse parameter."""
    if not per_request:
        return []
    return [
        (r, first, k + 1)
        for r, first, k in zip(req_ids, _first_rows(ks), ks, strict=True)
        if r in per_request
    ]


def _blocked_rows(
    ib: InputBatch, req_ids: list[str], ks: list[int], drafts: list[list[int]]
) -> tuple[list[int], list[int]]:
    """(rows, token ids) blocked this step, for the requests with `min_tokens` or bad words."""
    rows: list[int] = []
    ids: list[int] = []
    if not ib.blocking:
        return rows, ids
    for r, first, k, request_drafts in zip(req_ids, _first_rows(ks), ks, drafts, strict=True):
        if r not in ib.blocking:
            continue
        state = ib.states[r]
        params = state.sampling_params
        if not params.bad_words_token_ids and ib.num_output_tokens(r) >= params.min_tokens:
            continue
        token_ids = ib.token_ids_of(r)
        for j in range(k + 1):
            for token in blocked_tokens(state, token_ids, request_drafts[:j]):
                rows.append(first + j)
                ids.append(token)
    return rows, ids


def _penalty_inputs(
    ib: InputBatch,
    req_ids: list[str],
    ks: list[int],
    drafts: list[list[int]],
    index: torch.Tensor,
) -> tuple[list[list[int]], list[list[int]], tuple[torch.Tensor, ...]] | None:
    """Per row: output history (outputs, then the drafts before the row: row j is used
    only when drafts[:j] are accepted, i.e. are its real history), prompt, and the
    (presence, frequency, repetition) penalties; None when no request has penalties."""
    if not ib.penalized or not any(r in ib.penalized for r in req_ids):
        return None
    histories: list[list[int]] = []
    prompts: list[list[int]] = []
    for r, k, request_drafts in zip(req_ids, ks, drafts, strict=True):
        token_ids = ib.token_ids_of(r)
        num_prompt = ib.states[r].num_prompt_tokens
        output, prompt = token_ids[num_prompt:], token_ids[:num_prompt]
        for j in range(k + 1):
            histories.append(output + request_drafts[:j] if j else output)
            prompts.append(prompt)
    return histories, prompts, (ib.presence[index], ib.frequency[index], ib.repetition[index])


def expand_grammar_bitmask(
    so: SchedulerOutput, batch: FlatBatch, bitmask: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """The grammar backend's rows (1 + drafts per request of
    `so.structured_output_request_ids`, in that order) placed at this batch's sampled
    rows; unconstrained rows allow every token (all bits set)."""
    start: dict[str, int] = {}
    row = 0
    for req_id in so.structured_output_request_ids:
        start[req_id] = row
        row += 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
    if bitmask.shape[0] != row:
        raise ValueError(
            f"grammar_bitmask: {bitmask.shape[0]} rows, expected {row} (1 + drafts for "
            "each request of structured_output_request_ids)"
        )
    source: list[int] = []
    target: list[int] = []
    out_row = 0
    for r, k in zip(batch.sample_req_indices, batch.num_draft_tokens, strict=True):
        first = start.get(batch.req_ids[r])
        if first is not None:
            source.extend(range(first, first + k + 1))
            target.extend(range(out_row, out_row + k + 1))
        out_row += k + 1
    full = torch.full((out_row, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
    if source:
        full[torch.tensor(target, device=bitmask.device)] = bitmask[
            torch.tensor(source, device=bitmask.device)
        ]
    return full.to(device)
