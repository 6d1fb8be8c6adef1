"""Traffic for `tandem simulate`: when requests arrive and how long they are.

`parse_traffic` (in `traffic_spec`, re-exported here; grammar there) turns a CLI string such
as `gamma:rate=5,cv=3,n=1000,prompt=lognormal(1024,0.8)` into a `TrafficSpec`; `generate`
turns an open-loop spec into requests, `ClosedLoopClients` drives a closed-loop one, and
`prompt_token_ids` gives a request its token ids. Arrivals use `random.Random(seed)`, request
shapes a second stream of the same seed, so one seed gives the same shapes at every rate.

Trace layouts (`load_trace`), detected from the CSV header or the JSONL keys:
  tandem    arrival_s, prompt_tokens, output_tokens [, priority, prefix_group, prefix_tokens]
  Azure     TIMESTAMP (`2023-11-16 18:15:46.6805900`, any fraction digits, optional zone),
            ContextTokens, GeneratedTokens (Azure LLM inference traces 2023/2024)
  BurstGPT  Timestamp (seconds), Request tokens, Response tokens (rows with 0 response
            tokens are failures and are skipped)
Rows are sorted by arrival, shifted so the first arrives at 0, then scaled by `time_scale`.
Token counts are integers >= 0; a 0 becomes 1 (except BurstGPT failures, skipped).
"""

from __future__ import annotations

import array
import calendar
import csv
import functools
import json
import math
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tandem.simulate.constrained import SchemaPicker
from tandem.simulate.traffic_spec import KINDS, LengthDist, TrafficSpec, parse_traffic

__all__ = [
    "KINDS",
    "ClosedLoopClients",
    "LengthDist",
    "TrafficRequest",
    "TrafficSpec",
    "gamma_arrivals",
    "generate",
    "load_trace",
    "parse_traffic",
    "poisson_arrivals",
    "prompt_token_ids",
]


@dataclass(frozen=True, slots=True)
class TrafficRequest:
    """One request: arrival (seconds from the start, >= 0), prompt and output lengths (>= 1
    tokens; the output is generated to exactly that length, or up to it for a constrained
    one), priority (lower first), an optional prefix group whose members share their first
    `prefix_tokens` prompt tokens, and an optional JSON schema (JSON text) it must follow."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    prefix_group: int | None = None
    prefix_tokens: int = 0
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"traffic: invalid request {self}")
        if not 0 <= self.prefix_tokens <= self.prompt_tokens or (
            self.prefix_tokens and self.prefix_group is None
        ):
            raise ValueError(f"traffic: invalid prefix in {self}")


def _gap_sampler(rate: float, cv: float | None, rng: random.Random) -> Callable[[], float]:
    """Inter-arrival gaps (seconds) of mean 1/rate: exponential (cv None) or gamma."""
    if not rate > 0 or (cv is not None and not 0 < cv < math.inf):
        raise ValueError(f"traffic: need rate > 0 and cv > 0, got rate={rate}, cv={cv}")
    if rate == math.inf:
        return lambda: 0.0
    if cv is None:
        return lambda: rng.expovariate(rate)
    shape, scale = 1.0 / cv**2, cv**2 / rate
    return lambda: rng.gammavariate(shape, scale)


def _cumulative(gap: Callable[[], float], count: int) -> list[float]:
    times, now = [], 0.0
    for _ in range(count):
        now += gap()
        times.append(now)
    return times


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """`count` Poisson arrival times (s): cumulative exponential gaps of mean 1/rate, the
    first at the first gap (not 0). rate=inf: all 0.0."""
    return _cumulative(_gap_sampler(rate, None, rng), count)


def gamma_arrivals(rate: float, cv: float, count: int, rng: random.Random) -> list[float]:
    """`count` bursty arrival times (s): gamma gaps of mean 1/rate and coefficient of
    variation `cv` (shape 1/cv^2, scale cv^2/rate); cv=1 is Poisson in distribution."""
    return _cumulative(_gap_sampler(rate, cv, rng), count)


def _fit(prompt: int, output: int, max_model_len: int) -> tuple[int, int]:
    """Clamp so prompt + output <= max_model_len: the output first (>= 1), then the prompt."""
    output = max(1, min(output, max_model_len - prompt))
    return max(1, min(prompt, max_model_len - output)), output


def _check_max_len(max_model_len: int) -> int:
    if max_model_len < 2:
        raise ValueError(f"traffic: max_model_len must be >= 2, got {max_model_len}")
    return max_model_len


def _shape_rng(seed: int) -> random.Random:
    return random.Random(f"tandem.simulate.traffic.shapes:{seed}")


def _draw(spec: TrafficSpec, rng: random.Random, arrival: float, max_len: int) -> TrafficRequest:
    """One synthetic request arriving at `arrival`: prompt, output, priority, group, in order."""
    prompt, output = _fit(spec.prompt.draw(rng, max_len), spec.output.draw(rng, max_len), max_len)
    priority = rng.randrange(spec.priorities) if spec.priorities > 1 else 0
    if spec.prefix_groups == 0:
        return TrafficRequest(arrival, prompt, output, priority)
    group = rng.randrange(spec.prefix_groups)
    prefix = min(spec.prefix_tokens, prompt - 1)
    return TrafficRequest(arrival, prompt, output, priority, group, prefix)


def _arrivals(spec: TrafficSpec) -> list[float]:
    """Open-loop arrival times: `n` of them, or those up to `duration`, whichever ends first."""
    assert spec.rate is not None
    gap = _gap_sampler(
        spec.rate, spec.cv if spec.kind == "gamma" else None, random.Random(spec.seed)
    )
    if spec.duration_s is None:
        return _cumulative(gap, spec.num_requests or 0)
    times, now, limit = [], gap(), spec.num_requests or math.inf
    while now <= spec.duration_s and len(times) < limit:
        times.append(now)
        now += gap()
    return times


def generate(spec: TrafficSpec, max_model_len: int) -> list[TrafficRequest]:
    """The requests of an open-loop spec, by arrival; prompt + output <= max_model_len.
    Deterministic for a seed. Closed-loop specs go through `ClosedLoopClients`."""
    max_len = _check_max_len(max_model_len)
    if spec.kind == "closed":
        raise ValueError("traffic: closed-loop traffic is driven by ClosedLoopClients, not a list")
    schemas = SchemaPicker.of(spec)
    if spec.kind == "trace":
        assert spec.path is not None
        rows = load_trace(spec.path, time_scale=spec.time_scale, max_requests=spec.num_requests)
        out = []
        for r in rows:
            if spec.duration_s is not None and r.arrival_s > spec.duration_s:
                break
            prompt, output = _fit(r.prompt_tokens, r.output_tokens, max_len)
            prefix = min(r.prefix_tokens, prompt)
            out.append(
                TrafficRequest(r.arrival_s, prompt, output, r.priority, r.prefix_group, prefix)
            )
        return [schemas.apply(r) for r in out]
    rng = _shape_rng(spec.seed)
    return [schemas.apply(_draw(spec, rng, t, max_len)) for t in _arrivals(spec)]


class ClosedLoopClients:
    """`clients` clients, each sending its next request `think` seconds (exponential, mean
    think_s; 0 = at once) after its previous one finished, until `num_requests` have been
    issued (or, with `duration`, until the next would arrive after it). Each client has at
    most one request in flight; its first arrives after one think time (0.0 when think_s = 0).
    """

    def __init__(self, spec: TrafficSpec, max_model_len: int) -> None:
        if spec.kind != "closed":
            raise ValueError(f"traffic: ClosedLoopClients needs a closed spec, got {spec.kind!r}")
        self._spec = spec
        self._max_len = _check_max_len(max_model_len)
        self._think_rng = random.Random(spec.seed)
        self._rng = _shape_rng(spec.seed)
        self._schemas = SchemaPicker.of(spec)
        self._busy = [False] * spec.clients
        self._started = False
        self.issued = 0  #: requests issued so far (<= num_requests)

    def _think(self) -> float:
        mean = self._spec.think_s
        return self._think_rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def _issue(self, client: int, arrival: float) -> TrafficRequest | None:
        spec = self._spec
        if spec.num_requests is not None and self.issued >= spec.num_requests:
            return None
        if spec.duration_s is not None and arrival > spec.duration_s:
            return None
        self.issued += 1
        self._busy[client] = True
        return self._schemas.apply(_draw(spec, self._rng, arrival, self._max_len))

    def initial(self) -> list[tuple[int, TrafficRequest]]:
        """(client id, first request) per client, by arrival; call once."""
        if self._started:
            raise RuntimeError("traffic: ClosedLoopClients.initial() called twice")
        self._started = True
        firsts = [(c, self._issue(c, self._think())) for c in range(len(self._busy))]
        pairs = [(c, r) for c, r in firsts if r is not None]
        return sorted(pairs, key=lambda pair: pair[1].arrival_s)

    def on_finish(self, client: int, now_s: float) -> TrafficRequest | None:
        """Client `client`'s request finished at `now_s` (s): its next request, arriving at
        now_s + think, or None once the run's requests are all issued."""
        if not 0 <= client < len(self._busy) or not self._busy[client]:
            raise ValueError(f"traffic: client {client} has no request in flight")
        self._busy[client] = False
        return self._issue(client, now_s + self._think())


# --- token ids --------------------------------------------------------------------------

_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def _ids(seed: str, count: int, vocab_size: int) -> list[int]:
    """`count` ids in [0, vocab_size) from the stream named `seed`; a shorter draw is a
    prefix of a longer one. Modulo bias is below vocab_size / 2**32 (negligible)."""
    words = array.array(_U32, random.Random(seed).randbytes(4 * count))
    if sys.byteorder == "big":
        words.byteswap()
    return [w % vocab_size for w in words]


def prompt_token_ids(
    request: TrafficRequest, index: int, vocab_size: int, seed: int = 0
) -> list[int]:
    """`request.prompt_tokens` deterministic ids in [0, vocab_size): the first
    `prefix_tokens` depend only on (prefix_group, seed), so a group shares them; the rest on
    (index, seed), so different requests differ."""
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f"traffic: vocab_size must be in [1, 2**32], got {vocab_size}")
    prefix = request.prefix_tokens
    head = _ids(f"prefix:{request.prefix_group}:{seed}", prefix, vocab_size) if prefix else []
    return head + _ids(f"request:{index}:{seed}", request.prompt_tokens - prefix, vocab_size)


# --- trace files --------------------------------------------------------------------------

#: A trace row: ((whole seconds, fraction in [0, 1)), prompt, output, priority, group, prefix).
_Row = tuple[tuple[int, float], int, int, int, int | None, int]
_Cell = Callable[[str, str], Any]  # (column, what) -> the parsed value of this row
_LAYOUTS = {
    "tandem": ("arrival_s", "prompt_tokens", "output_tokens"),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
_STAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?"
)


def _seconds(raw: Any) -> tuple[int, float]:
    """A seconds value split exactly enough: (floor, fraction)."""
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    whole = math.floor(value)
    return whole, value - whole


def _datetime(raw: Any) -> tuple[int, float]:
    """`YYYY-MM-DD HH:MM:SS[.fraction][zone]` as (whole seconds since the epoch, fraction),
    without float rounding of the 7-digit fractions of the Azure traces."""
    match = _STAMP.fullmatch(str(raw).strip())
    if match is None:
        raise ValueError(raw)
    parts = [int(g) for g in match.groups()[:6]]
    datetime(*parts)  # rejects impossible dates
    whole = calendar.timegm((*parts, 0, 0, 0))
    zone = match.group(8)
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        whole -= sign * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
    digits = match.group(7) or "0"
    return whole, int(digits) / 10 ** len(digits)


def _tokens(raw: Any) -> int:
    value = float(raw)  # "12", 12 and 12.0 are 12; 12.5, -1, nan and inf are errors
    if value < 0 or not value.is_integer():
        raise ValueError(raw)
    return int(value)


def _parse_row(layout: str, cell: _Cell) -> _Row | None:
    """One row of `layout`; `cell` reads and converts a column, naming it on failure."""
    stamp, prompt_col, output_col = _LAYOUTS[layout]
    when = cell(stamp, "datetime") if layout == "azure" else cell(stamp, "seconds")
    prompt, output = cell(prompt_col, "tokens"), cell(output_col, "tokens")
    if layout == "burstgpt" and output == 0:
        return None  # a failed request
    priority, group, prefix = 0, None, 0
    if layout == "tandem":
        priority = cell("priority", "int?") or 0
        group = cell("prefix_group", "int?")
        prefix = cell("prefix_tokens", "tokens?") or 0
        if prefix and group is None:
            cell("prefix_group", "int")  # prefix tokens need a group: report it missing
    return when, max(1, prompt), max(1, output), priority, group, min(prefix, max(1, prompt))


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "datetime": _datetime,
    "seconds": _seconds,
    "tokens": _tokens,
    "int": int,
}


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line, row) of a CSV file (by its header) or a JSONL file (one object a line)."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        first = f.readline()
        f.seek(0)
        if first.lstrip().startswith("{"):
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        record = None
                    if not isinstance(record, dict):
                        raise ValueError(f"{path}:{line_no}: expected a JSON object per line")
                    yield line_no, record
            return
        reader = csv.DictReader(f, skipinitialspace=True)
        reader.fieldnames = [name.strip() for name in reader.fieldnames or []]
        for row in reader:
            yield reader.line_num, row


_EXPECTED = {"tokens": "an integer >= 0", "seconds": "a number of seconds", "int": "an integer"}


def _cell(path: Path, line_no: int, record: dict[str, Any], column: str, what: str) -> Any:
    """`record[column]` converted as `what` (a `_CONVERT` key; a trailing "?" makes an empty
    cell None); ValueError naming the file, line and column when it is missing or bad."""
    raw = record.get(column)
    raw = raw.strip() if isinstance(raw, str) else raw
    kind = what.rstrip("?")
    if kind != what and raw in (None, ""):
        return None
    try:
        return _CONVERT[kind](raw)
    except (TypeError, ValueError, OverflowError):
        expected = _EXPECTED.get(kind, kind)
        raise ValueError(
            f"{path}:{line_no}: column {column!r}: expected {expected}, got {raw!r}"
        ) from None


def _read_rows(path: Path) -> list[_Row]:
    rows: list[_Row] = []
    layout = ""
    for line_no, record in _records(path):
        if not layout:
            found = [name for name, cols in _LAYOUTS.items() if set(cols) <= record.keys()]
            if not found:
                raise ValueError(
                    f"{path}: unknown trace layout (columns {sorted(record)}); expected the "
                    f"columns of one of: {'; '.join(', '.join(c) for c in _LAYOUTS.values())}"
                )
            layout = found[0]
        row = _parse_row(layout, functools.partial(_cell, path, line_no, record))
        if row is not None:
            rows.append(row)
    return rows


def load_trace(
    path: str | Path, *, time_scale: float = 1.0, max_requests: int | None = None
) -> list[TrafficRequest]:
    """The requests of a trace file (layouts in the module docstring), by arrival: the first
    at 0.0 s, arrivals multiplied by `time_scale`, at most `max_requests` (the earliest).
    ValueError names the file, the 1-based line and the column of a bad value."""
    if not 0 < time_scale < math.inf:
        raise ValueError(f"traffic: time_scale must be a positive number, got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"traffic: max_requests must be >= 1, got {max_requests}")
    path = Path(path)
    rows = sorted(_read_rows(path), key=lambda row: row[0])[:max_requests]
    if not rows:
        raise ValueError(f"{path}: the trace has no requests")
    (w0, f0), last, out = rows[0][0], 0.0, []
    for (whole, frac), prompt, output, priority, group, prefix in rows:
        last = max(last, ((whole - w0) + (frac - f0)) * time_scale)  # non-decreasing
        out.append(TrafficRequest(last, prompt, output, priority, group, prefix))
    return out
