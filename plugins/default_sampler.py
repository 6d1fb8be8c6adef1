"""The default sampler plugin: vectorised over the batch, seeded by (seed, output index).

Per row: grammar bitmask, penalties (presence, frequency, repetition), then greedy argmax
when temperature is 0, else temperature, top-k, top-p, min-p and a Gumbel-max draw. The
Gumbel noise of a seeded row is a counter-based hash of (seed, output position, token id),
so a seeded request samples the same tokens in any batch and under sync or async
scheduling. Draft verification: each row samples its target token independently; a
request keeps its drafts while they equal the targets, then one more target token. For a
deterministic drafter this is exact rejection sampling (accept with probability p(draft);
on rejection the target is distributed as p without the draft, renormalised).
"""

from __future__ import annotations

import torch

from tandem.core import hookimpl
from tandem.core.model_runner_output import SamplerOutput
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.worker.sampling_metadata import SamplingMetadata

_MASK53 = (1 << 53) - 1
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic)."""
    x = (x ^ _logical_shift(x, 30)) * _MIX1
    x = (x ^ _logical_shift(x, 27)) * _MIX2
    return x ^ _logical_shift(x, 31)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise `[rows, vocab]`: a hash of (seed, position, token), each stage
    fully mixed so that nearby seeds, positions and tokens give independent draws."""
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    row = _mix(_mix(seeds * _GOLDEN + 1) ^ (positions * _GOLDEN + 2))
    x = _mix(row[:, None] ^ (token[None, :] * _MIX1 + 3))
    u = (_logical_shift(x, 11) & _MASK53).to(torch.float64) / float(1 << 53)
    return u.clamp_(1e-12, 1.0 - 1e-12).to(torch.float32)


def _counts(
    histories: list[list[int]], rows: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """`[rows, vocab]` occurrence counts of each row's tokens (-1 placeholders skipped)."""
    counts = torch.zeros((rows, vocab), dtype=torch.float32, device=device)
    lengths = [len(h) for h in histories]
    if sum(lengths):
        row_index = torch.repeat_interleave(torch.arange(rows), torch.tensor(lengths))
        tokens = torch.tensor([t for h in histories for t in h], dtype=torch.int64)
        keep = tokens >= 0
        counts.index_put_(
            (row_index[keep].to(device), tokens[keep].to(device)),
            torch.ones(int(keep.sum()), device=device),
            accumulate=True,
        )
    return counts


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """In place, as vLLM: repetition over prompt and output tokens (divide positive logits,
    multiply negative ones), frequency (minus count * f) and presence (minus p if seen)
    over output tokens only."""
    histories = metadata.output_token_ids
    if histories is None or metadata.penalties is None:
        return
    rows, vocab = logits.shape
    presence, frequency, repetition = (t.to(logits.device) for t in metadata.penalties)
    counts = _counts(histories, rows, vocab, logits.device)
    seen = counts > 0
    if bool((repetition != 1.0).any()):
        in_prompt = (
            _counts(
                metadata.prompt_token_ids or [[] for _ in range(rows)], rows, vocab, logits.device
            )
            > 0
        )
        repeated = seen | in_prompt
        rep = repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(repeated, penalised, logits))
    logits -= frequency[:, None] * counts
    logits -= presence[:, None] * seen.to(logits.dtype)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf where the int32 bitmask (32 tokens per word, LSB first) has a 0 bit."""
    rows, vocab = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:rows, :, None] >> bits) & 1).bool().reshape(rows, -1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def filter_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Return logits with -inf outside each row's top-k, top-p nucleus and min-p floor."""
    vocab = logits.shape[1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = logits.sort(dim=1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        mass_before = probs.cumsum(dim=1) - probs
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=1)
        floor = probs.max(dim=1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class DefaultSampler(TandemPlugin):
    """Greedy, temperature, top-k/p, min-p, penalties, seeds; verifies drafts exactly."""

    role = "sampler"
    applies_grammar_bitmask = True

    def __init__(self, config, options) -> None:  # noqa: ANN001
        super().__init__(config, options)
        self.generator = torch.Generator().manual_seed(config.model.seed)

    @hookimpl(trylast=True)
    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.to(torch.float32)
        raw_logprobs = logits.log_softmax(dim=1) if metadata.max_num_logprobs is not None else None
        if metadata.grammar_bitmask is not None:
            apply_bitmask(logits, metadata.grammar_bitmask.to(logits.device))
        if metadata.output_token_ids is not None:
            apply_penalties(logits, metadata)
        if metadata.blocked_tokens is not None:
            rows, tokens = metadata.blocked_tokens
            logits[rows.to(logits.device), tokens.to(logits.device)] = float("-inf")
        targets = self._sample_rows(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, targets, metadata.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=self._verify(targets, metadata), logprobs=logprobs)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, targets: torch.Tensor, num_top: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: the sampled token then the top `num_top`, their logprobs (of the raw
        model distribution), and the sampled token's rank (1 = most likely)."""
        sampled = raw.gather(1, targets[:, None])
        ranks = (raw > sampled).sum(dim=1) + 1
        if num_top > 0:
            top = raw.topk(num_top, dim=1)
            return (
                torch.cat([targets[:, None], top.indices], dim=1),
                torch.cat([sampled, top.values], dim=1),
                ranks,
            )
        return targets[:, None], sampled, ranks

    def _sample_rows(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=1)
        if metadata.all_greedy:
            return greedy
        temperature = metadata.temperature
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = filter_top_k_top_p_min_p(scaled, metadata.top_k, metadata.top_p, metadata.min_p)
        rows, vocab = scaled.shape
        uniform = torch.rand((rows, vocab), generator=self.generator).to(scaled.device)
        seeded = metadata.seeds >= 0
        if bool(seeded.any()):
            idx = seeded.nonzero().squeeze(1)
            uniform[idx] = seeded_uniform(
                metadata.seeds[idx], metadata.output_positions[idx], vocab
            )
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-12, 1.0 - 1e-7)))
        drawn = (scaled + gumbel).argmax(dim=1)
        return torch.where(temperature > 0, drawn, greedy)

    @staticmethod
    def _verify(targets: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """`[num_requests, 1 + max_drafts]`: accepted drafts then one target, -1 padded."""
        num_drafts = metadata.num_draft_tokens
        max_k = max(num_drafts, default=0)
        if max_k == 0:
            return targets[:, None]
        device = targets.device
        counts = torch.tensor(num_drafts, dtype=torch.int64, device=device)
        starts = torch.cumsum(counts + 1, 0) - (counts + 1)
        j = torch.arange(max_k + 1, device=device)
        valid = j[None, :] <= counts[:, None]
        index = (starts[:, None] + j[None, :]).clamp(max=targets.numel() - 1)
        grid = torch.where(valid, targets[index], -1)
        draft_grid = torch.full((len(num_drafts), max_k), -2, dtype=torch.int64, device=device)
        draft_start = torch.cumsum(counts, 0) - counts
        dvalid = j[None, :max_k] < counts[:, None]
        didx = (draft_start[:, None] + j[None, :max_k]).clamp(
            max=max(metadata.draft_token_ids.numel() - 1, 0)
        )
        if metadata.draft_token_ids.numel():
            draft_grid = torch.where(dvalid, metadata.draft_token_ids.to(device)[didx], -2)
        accepted = (grid[:, :max_k] == draft_grid).to(torch.int64).cumprod(dim=1).sum(dim=1)
        return torch.where(j[None, :] <= accepted[:, None], grid, -1)
