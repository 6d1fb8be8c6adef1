"""The rejection sampler: emitted tokens follow the target distribution p exactly, for a
draft distribution q != p, for a deterministic drafter (one-hot q) and at the bonus
position; greedy verification; through the default sampler, a seeded request reproducible in any
batch.

Statistical tests draw N = 200,000 independent verifications with fixed generators (so they
are deterministic) and compare the empirical distribution with p by Pearson's chi-square
(vocabulary 6: 5 degrees of freedom; the 1e-4 critical value is 25.74) and by total
variation distance (bound 0.01; the expected TV at this N is about 0.002).
"""

from __future__ import annotations

import pytest
import torch

from tandem.core.plugin_manager import NoOptions
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.plugins.default_sampler import DefaultSampler
from tandem.spec_decode.rejection_sampler import rejection_sample
from tandem.stack_file import load_config

V = 6
N = 200_000
CHI2_CRIT_DF5 = 25.74  # P(chi2_5 > 25.74) = 1e-4
TV_BOUND = 0.01

P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05], dtype=torch.float64)
Q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10], dtype=torch.float64)
P_BONUS = torch.tensor([0.02, 0.08, 0.10, 0.15, 0.25, 0.40], dtype=torch.float64)


def gumbel(gen: torch.Generator, *shape: int) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return -torch.log(-torch.log(u))


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor) -> None:
    counts = torch.bincount(tokens, minlength=V).to(torch.float64)
    n = counts.sum()
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    tv = float((counts / n - p).abs().sum() / 2)
    assert chi2 < CHI2_CRIT_DF5, (chi2, counts / n, p)
    assert tv < TV_BOUND, (tv, counts / n, p)


def verify_one_draft(
    p_draft_row: torch.Tensor,
    p_bonus_row: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
) -> torch.Tensor:
    """N requests, one draft each: rows alternate (draft row, bonus row)."""
    gen = torch.Generator().manual_seed(1234)
    probs = torch.stack([p_draft_row, p_bonus_row]).repeat(N, 1)
    bonus = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return rejection_sample(
        target_token_ids=bonus,
        target_probs=probs,
        draft_token_ids=drafts,
        num_draft_tokens=[1] * N,
        draft_probs=None if q is None else q.expand(N, V),
        accept_uniform=torch.rand(2 * N, generator=gen, dtype=torch.float64),
        recovery_gumbel=gumbel(gen, 2 * N, V),
    )


def test_first_token_follows_p_for_a_draft_distribution_q_unlike_p() -> None:
    gen = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(Q, N, replacement=True, generator=gen)
    out = verify_one_draft(P, P_BONUS, drafts, Q)
    assert_distributed_as(out[:, 0], P)
    # Not trivially all-accepted or all-rejected: the acceptance rate is sum min(p, q).
    accepted = float((out[:, 1] >= 0).to(torch.float64).mean())
    assert accepted == pytest.approx(float(torch.minimum(P, Q).sum()), abs=0.005)


def test_first_token_follows_p_for_a_deterministic_drafter() -> None:
    drafts = torch.full((N,), 2, dtype=torch.int64)  # one-hot q at token 2
    out = verify_one_draft(P, P_BONUS, drafts, None)
    assert_distributed_as(out[:, 0], P)
    assert float((out[:, 1] >= 0).to(torch.float64).mean()) == pytest.approx(0.20, abs=0.005)


def test_bonus_token_follows_the_bonus_rows_p_when_all_drafts_are_accepted() -> None:
    gen = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(Q, N, replacement=True, generator=gen)
    out = verify_one_draft(P, P_BONUS, drafts, Q)
    accepted = out[:, 1] >= 0
    assert int(accepted.sum()) > N // 3
    assert_distributed_as(out[accepted, 1], P_BONUS)
    assert bool((out[~accepted, 1] == -1).all())


def test_greedy_rows_accept_while_equal_to_the_argmax_then_emit_it() -> None:
    # request 0: drafts [3, 1, 4], argmaxes [3, 1, 5, 2] -> [3, 1, 5, -1]
    # request 1: no drafts, argmax 0 -> [0]; request 2: drafts [2, 2], argmaxes [2, 2, 4]
    argmax = torch.tensor([3, 1, 5, 2, 0, 2, 2, 4])
    probs = torch.nn.functional.one_hot(argmax, V).to(torch.float64)
    out = rejection_sample(
        target_token_ids=argmax,
        target_probs=probs,
        draft_token_ids=torch.tensor([3, 1, 4, 2, 2]),
        num_draft_tokens=[3, 0, 2],
        draft_probs=None,
        accept_uniform=torch.full((8,), 0.999, dtype=torch.float64),
        recovery_gumbel=torch.zeros(8, V, dtype=torch.float64),
    )
    assert out.tolist() == [[3, 1, 5, -1], [0, -1, -1, -1], [2, 2, 4, -1]]


def test_second_draft_is_only_judged_after_the_first_is_accepted() -> None:
    """Two drafts with q = p at both: every draft is accepted (p/q = 1), so both drafts and
    the bonus come out. A deterministic drafter whose first draft differs from the row's
    own draw gets the draw and nothing more."""
    common = {
        "target_token_ids": torch.tensor([1, 3, 4]),
        "draft_token_ids": torch.tensor([0, 5]),
        "num_draft_tokens": [2],
    }
    out = rejection_sample(
        **common,
        target_probs=torch.stack([P, P, P_BONUS]),
        draft_probs=torch.stack([P, P]),
        accept_uniform=torch.full((3,), 0.999, dtype=torch.float64),
        recovery_gumbel=torch.zeros(3, V, dtype=torch.float64),
    )
    assert out.tolist() == [[0, 5, 4]]
    assert rejection_sample(**common).tolist() == [[1, -1, -1]]
    assert rejection_sample(torch.tensor([0, 5, 4]), torch.tensor([0, 5]), [2]).tolist() == [
        [0, 5, 4]
    ]


def test_without_drafts_each_row_emits_its_own_draw() -> None:
    draws = torch.tensor([4, 0, 2])
    assert rejection_sample(draws, torch.zeros(0, dtype=torch.int64), [0, 0, 0]).tolist() == [
        [4],
        [0],
        [2],
    ]


def sampler_metadata(
    rows: list[tuple[int, int, float]], num_drafts: list[int], drafts: list[int], q: torch.Tensor
) -> SamplingMetadata:
    """Rows given as (seed, output position, temperature)."""
    n = len(rows)
    return SamplingMetadata(
        all_greedy=False,
        temperature=torch.tensor([t for _, _, t in rows], dtype=torch.float32),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        seeds=torch.tensor([s for s, _, _ in rows], dtype=torch.int64),
        output_positions=torch.tensor([p for _, p, _ in rows], dtype=torch.int64),
        num_draft_tokens=num_drafts,
        draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
        draft_probs=q,
    )


def test_default_sampler_with_draft_probs_is_seeded_per_request_not_per_batch() -> None:
    """A seeded request verifying drafts with a drafter's q emits the same tokens alone and
    after other requests in the batch (its randomness is (seed, position), not the batch)."""
    sampler = DefaultSampler(
        load_config(None, model="scripted", vocab_size=V),
        NoOptions(),  # type: ignore[arg-type]
    )
    logits = torch.log(torch.stack([P, P, P_BONUS])).to(torch.float32)
    q = torch.stack([Q, Q]).to(torch.float32)
    results = set()
    accepted = 0
    for seed in range(40):
        mine = [(seed, 10, 1.0), (seed, 11, 1.0), (seed, 12, 1.0)]
        alone = sampler.sample(logits.clone(), sampler_metadata(mine, [2], [2, 4], q))
        other_logits = torch.log(torch.stack([P_BONUS, P])).to(torch.float32)
        batch = sampler.sample(
            torch.cat([other_logits, logits]),
            sampler_metadata(
                [(-1, 3, 1.0), (77, 0, 0.7), *mine], [0, 0, 2], [2, 4], torch.cat([q])
            ),
        )
        assert batch.sampled_token_ids[2].tolist() == alone.sampled_token_ids[0].tolist()
        results.add(tuple(alone.sampled_token_ids[0].tolist()))
        accepted += int(alone.sampled_token_ids[0, 1] >= 0)
    assert len(results) > 5 and 0 < accepted < 40  # really random, some drafts rejected
