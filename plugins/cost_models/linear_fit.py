"""A step's cost as a non-negative linear function of its shape: the features and the fit.

`tandem simulate calibrate` times real steps and fits, by non-negative least squares
(`nnls`, Lawson-Hanson's active-set method on numpy), seconds = coef . features(step) with
these features of a `StepShape` (`FEATURES`, in this order):

- `const`: 1 per step with tokens (launch, input preparation, Python per step);
- `num_tokens`: tokens computed this step (the linear layers: weights x tokens);
- `num_reqs`: requests scheduled (per-request gathers, block tables, sampling setup);
- `decode_kv`: sum over decode requests (query_len == 1) of their context_len (the KV a
  decode reads: memory-bound attention);
- `prefill_attn`: sum over longer queries of query_len x (context_len + query_len / 2)
  (causal attention work of a prefill chunk over its cached context);
- `num_sampled`: requests that sample (the LM head and the sampler);
- `tokens_A_B` (`TOKEN_SEGMENTS`): the part of `num_tokens` between A and B (`tokens_0_4`
  = min(tokens, 4), `tokens_4_16` = min(max(tokens - 4, 0), 12), ..., `tokens_1024_up`),
  which sum to `num_tokens`.

`tandem simulate calibrate` fits `FIT_FEATURES`: `num_tokens` as its segments, so the
linear layers' cost is a non-decreasing piecewise-linear curve of the step's rows, one slope
per segment, rather than one slope for every size. A CPU's GEMM changes strategy with the
row count (a register tile for a few rows, a packed panel path for many; see
docs/quantization.md), and with one slope the fit priced a 16-token prefill from the slope
of 2,048-token ones (34% above its measured time on a Sapphire Rapids CPU) and a decode of
one request from the average of every batch size. A fit file may use any subset of
`FEATURES` (version-1 files name `num_tokens`).

Non-negative coefficients keep every prediction >= 0 and non-decreasing in every feature.
A step without tokens costs 0 (it does not run). Units: features are counts (tokens,
requests, token pairs); coefficients are seconds per unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.core.worker.step_shape import StepShape

#: Where the token segments break (tokens): the grid times steps on both sides of each.
TOKEN_KNOTS: tuple[int, ...] = (4, 16, 64, 256, 1024)
#: The segment features, one per interval between consecutive knots (0 to the first, the
#: last to unbounded).
TOKEN_SEGMENTS: tuple[str, ...] = tuple(
    f"tokens_{low}_{high}" for low, high in zip((0, *TOKEN_KNOTS[:-1]), TOKEN_KNOTS, strict=True)
) + (f"tokens_{TOKEN_KNOTS[-1]}_up",)
#: Every feature name, in the order of `step_features`.
FEATURES: tuple[str, ...] = (
    "const",
    "num_tokens",
    "num_reqs",
    "decode_kv",
    "prefill_attn",
    "num_sampled",
    *TOKEN_SEGMENTS,
)
#: The features `tandem simulate calibrate` fits (module docstring): `num_tokens` as its
#: segments (including both would make the columns linearly dependent).
FIT_FEATURES: tuple[str, ...] = tuple(name for name in FEATURES if name != "num_tokens")


def token_segments(tokens: int) -> list[float]:
    """`tokens` split over `TOKEN_SEGMENTS` (the parts sum to `tokens`)."""
    parts, low = [], 0
    for high in TOKEN_KNOTS:
        parts.append(float(min(max(tokens - low, 0), high - low)))
        low = high
    parts.append(float(max(tokens - low, 0)))
    return parts


def step_features(step: StepShape) -> list[float]:
    """The `FEATURES` of `step` (all 0.0 for a step without tokens)."""
    if step.num_tokens == 0:
        return [0.0] * len(FEATURES)
    decode_kv = prefill_attn = 0.0
    for q, c in zip(step.query_lens, step.context_lens, strict=True):
        if q == 1:
            decode_kv += c
        elif q > 1:
            prefill_attn += q * (c + q / 2)
    return [
        1.0,
        float(step.num_tokens),
        float(step.num_reqs),
        decode_kv,
        prefill_attn,
        float(step.num_sampled),
        *token_segments(step.num_tokens),
    ]


def select(row: Sequence[float], names: Sequence[str]) -> list[float]:
    """The values of `names` (a subset of `FEATURES`) from a `step_features` row."""
    return [row[FEATURES.index(name)] for name in names]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b||_2 subject to x >= 0 (Lawson and Hanson's active-set method).

    `a`: (m, n), `b`: (m,). Returns x of shape (n,). Columns that are all zero get 0.
    Raises ValueError on mismatched shapes or non-finite input."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls: expected a (m, n) and b (m,), got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("nnls: a and b must be finite")
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(a.shape) * max(np.abs(a).sum(axis=0).max(), 1.0)
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            if passive.any():
                z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            blocking = passive & (z <= 0)
            step = np.min(x[blocking] / np.maximum(x[blocking] - z[blocking], 1e-300))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
    return np.maximum(x, 0.0)


@dataclass(frozen=True, slots=True)
class LinearFit:
    """Non-negative coefficients (one per column) and the fit's quality on its samples:
    `r2` (coefficient of determination of the seconds, unweighted), `median_abs_rel_error`
    (median of |predicted - measured| / measured) and `samples` (rows fitted)."""

    coef: tuple[float, ...]
    r2: float
    median_abs_rel_error: float
    samples: int

    def predict(self, row: Sequence[float]) -> float:
        return float(sum(c * f for c, f in zip(self.coef, row, strict=True)))


def fit_nonnegative(
    rows: Sequence[Sequence[float]],
    seconds: Sequence[float],
    relative: bool = True,
    counts: Sequence[float] | None = None,
) -> LinearFit:
    """Fit `seconds ~ coef . row` with coef >= 0. `relative`: weigh each row by 1/seconds,
    so the fit minimises relative errors (steps span milliseconds to seconds; unweighted,
    the longest steps alone would set it). `counts` (> 0, default 1 each): how many steps
    each row stands for; a row's squared error counts that many times, so a shape that
    traffic runs often weighs as often. Columns are scaled to unit maximum before solving
    (conditioning) and the coefficients scaled back. Needs at least one row and every
    measured value > 0 (ValueError otherwise). The quality figures (`r2`,
    `median_abs_rel_error`) are over the rows, unweighted."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if a.ndim != 2 or len(a) == 0 or y.shape != (len(a),):
        raise ValueError("fit: need one row of features per measured time, at least one")
    if not (y > 0).all():
        raise ValueError("fit: every measured time must be > 0 seconds")
    n = np.ones_like(y) if counts is None else np.asarray(counts, dtype=float)
    if n.shape != y.shape or not (np.isfinite(n).all() and (n > 0).all()):
        raise ValueError("fit: counts must be one finite value > 0 per row")
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    weights = (1.0 / y if relative else np.ones_like(y)) * np.sqrt(n)
    coef = nnls(a / scale * weights[:, None], y * weights) / scale
    predicted = a @ coef
    residual = float(((y - predicted) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)
    rel = float(np.median(np.abs(predicted - y) / y))
    return LinearFit(tuple(float(c) for c in coef), r2, rel, len(y))
