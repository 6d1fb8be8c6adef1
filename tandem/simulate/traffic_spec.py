"""The traffic spec of `tandem simulate`: `KIND:key=value,key=value,...` and its fields.

Commas inside parentheses belong to the value:

    poisson:rate=20,n=1000,prompt=512,output=128
    gamma:rate=5,cv=3,duration=3600,prompt=lognormal(1024,0.8),output=uniform(32,256),
          prefix_groups=8,prefix=256,seed=1                              (one line)
    trace:path=azure_conv.csv,time_scale=0.5,n=5000
    closed:clients=16,think=0.5,n=500,prompt=256,output=64

Kinds and their keys (`n` or `duration` is required except for `trace`):
  poisson  rate (requests/s; `inf` = all at t=0)     open loop, exponential gaps
  gamma    rate, cv (gap coefficient of variation)   open loop, bursty when cv > 1
  trace    path, time_scale (arrival multiplier)     replays a file (`traffic.load_trace`)
  closed   clients, think (mean seconds, exponential) each client waits for its answer
Common to poisson, gamma, closed: n (requests), duration (s: arrivals up to this time; with
`n` too, whichever ends first), prompt, output (default 512, 128), prefix_groups and prefix
(requests pick one of `prefix_groups` groups uniformly; a group shares its first `prefix`
prompt tokens, clamped to prompt - 1), priorities (uniform over range(priorities); lower
is served first). `trace` also takes n and duration. Every kind takes seed (default 0),
json (the fraction in [0, 1] of requests constrained by a JSON schema; default 0) and
schema (a JSON file holding one schema or a list of them; default: the built-in set of
`tandem.simulate.constrained`), e.g. `poisson:rate=5,n=200,json=0.3`.
Lengths: `N` (fixed), `uniform(lo,hi)` (inclusive), `lognormal(mean,sigma[,max])` (sigma of
the underlying normal, its mu chosen so the mean is `mean`). A bad spec raises ValueError
naming the key and what it expects.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KINDS = ("poisson", "gamma", "trace", "closed")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: "fixed" (`mean`), "uniform" (`low`..`high` inclusive) or
    "lognormal" (mean `mean`, `sigma` of the underlying normal). `high` = 0: no bound but
    the `max_len` of `draw`."""

    kind: str
    mean: int
    low: int = 1
    high: int = 0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"traffic: unknown length distribution {self.kind!r}")
        if self.mean < 1 or self.low < 1 or (self.high and self.high < self.low):
            raise ValueError(f"traffic: lengths need 1 <= mean, 1 <= low <= high: {self}")
        if not 0.0 <= self.sigma < math.inf:
            raise ValueError(f"traffic: lognormal sigma must be >= 0, got {self.sigma}")

    def draw(self, rng: random.Random, max_len: int) -> int:
        """A length in [1, max_len] (and in [low, high] where those fit)."""
        upper = min(self.high or max_len, max_len)
        if self.kind == "fixed":
            value = self.mean
        elif self.kind == "uniform":
            value = rng.randint(self.low, max(self.low, upper))
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2
            value = max(self.low, round(rng.lognormvariate(mu, self.sigma)))
        return max(1, min(value, upper))


@dataclass(frozen=True, slots=True)
class TrafficSpec:
    """A parsed traffic spec (see the module docstring; `parse_traffic` builds one). Times
    in seconds, `rate` in requests/s. Invariants are checked on construction."""

    kind: str
    rate: float | None = None
    cv: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    prompt: LengthDist = LengthDist("fixed", 512)
    output: LengthDist = LengthDist("fixed", 128)
    prefix_groups: int = 0
    prefix_tokens: int = 0
    priorities: int = 1
    path: str | None = None
    time_scale: float = 1.0
    clients: int = 0
    think_s: float = 0.0
    seed: int = 0
    json_fraction: float = 0.0
    schema_path: str | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if kind not in KINDS:
            raise ValueError(f"traffic: unknown kind {kind!r}; expected one of {KINDS}")
        if kind in ("poisson", "gamma"):
            if self.rate is None or not self.rate > 0:
                raise ValueError(f"traffic: {kind} needs 'rate' > 0 (requests/s)")
            if kind == "gamma" and not (0 < self.cv < math.inf and self.rate < math.inf):
                raise ValueError("traffic: gamma needs a finite 'rate' and 'cv' > 0")
            if self.rate == math.inf and self.num_requests is None:
                raise ValueError("traffic: 'rate=inf' needs 'n' (a burst of n requests)")
        if kind == "trace" and not self.path:
            raise ValueError("traffic: trace needs 'path' (a trace file)")
        if kind == "closed" and self.clients < 1:
            raise ValueError("traffic: closed needs 'clients' >= 1")
        if kind != "trace" and self.num_requests is None and self.duration_s is None:
            raise ValueError(f"traffic: {kind} needs 'n' (requests) or 'duration' (seconds)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("traffic: 'n' must be >= 1")
        if self.duration_s is not None and not 0 < self.duration_s < math.inf:
            raise ValueError("traffic: 'duration' must be a positive number of seconds")
        if self.prefix_groups < 0 or self.prefix_tokens < 0 or self.priorities < 1:
            raise ValueError("traffic: need prefix_groups >= 0, prefix >= 0, priorities >= 1")
        if (self.prefix_groups > 0) != (self.prefix_tokens > 0):
            raise ValueError("traffic: 'prefix_groups' and 'prefix' go together (both > 0)")
        if not (0 < self.time_scale < math.inf and 0 <= self.think_s < math.inf):
            raise ValueError("traffic: need 'time_scale' > 0 and 'think' >= 0 (seconds)")
        if not 0.0 <= self.json_fraction <= 1.0:
            raise ValueError(
                f"traffic: 'json' must be a fraction in [0, 1], got {self.json_fraction}"
            )
        if self.schema_path is not None and self.json_fraction == 0.0:
            raise ValueError("traffic: 'schema' needs 'json' > 0 (the fraction it constrains)")


# --- the CLI spec ------------------------------------------------------------------------


def _bad(key: str, what: str, raw: str) -> ValueError:
    return ValueError(f"traffic: {key!r} must be {what}, got {raw!r}")


def _number(key: str, raw: str, what: str, *, low: float, strict: bool, inf: bool) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise _bad(key, what, raw) from None
    if not (value > low if strict else value >= low) or (value == math.inf and not inf):
        raise _bad(key, what, raw)
    return value


def _integer(key: str, raw: str, what: str, low: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise _bad(key, what, raw) from None
    if value < low:
        raise _bad(key, what, raw)
    return value


_LENGTH = re.compile(r"(uniform|lognormal)\(([^()]*)\)")


def _length(key: str, raw: str) -> LengthDist:
    what = "an integer >= 1, uniform(lo,hi) or lognormal(mean,sigma[,max])"
    match = _LENGTH.fullmatch(raw.replace(" ", ""))
    if match is None:
        return LengthDist("fixed", _integer(key, raw, what, 1))
    args = match.group(2).split(",")
    try:
        if match.group(1) == "uniform" and len(args) == 2:
            low, high = int(args[0]), int(args[1])
            return LengthDist("uniform", max(1, (low + high) // 2), low=low, high=high)
        if match.group(1) == "lognormal" and len(args) in (2, 3):
            high = int(args[2]) if len(args) == 3 else 0
            return LengthDist("lognormal", int(args[0]), high=high, sigma=float(args[1]))
    except ValueError:
        pass
    raise _bad(key, what, raw)


def _pos(what: str, inf: bool = False) -> Callable[[str, str], float]:
    return lambda k, v: _number(k, v, f"a positive number ({what})", low=0, strict=True, inf=inf)


def _nonneg(what: str) -> Callable[[str, str], float]:
    return lambda k, v: _number(k, v, f"a number >= 0 ({what})", low=0, strict=False, inf=False)


def _count(low: int) -> Callable[[str, str], int]:
    return lambda k, v: _integer(k, v, f"an integer >= {low}", low)


def _fraction(key: str, raw: str) -> float:
    value = _number(key, raw, "a fraction in [0, 1]", low=0, strict=False, inf=False)
    if value > 1:
        raise _bad(key, "a fraction in [0, 1]", raw)
    return value


def _path(key: str, raw: str) -> str:
    if not raw:
        raise _bad(key, "a file path", raw)
    return raw


#: CLI key -> (TrafficSpec field, parser of the raw value).
_KEYS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "rate": ("rate", _pos("requests/s", inf=True)),
    "cv": ("cv", _pos("coefficient of variation")),
    "n": ("num_requests", _count(1)),
    "duration": ("duration_s", _pos("seconds")),
    "prompt": ("prompt", _length),
    "output": ("output", _length),
    "prefix_groups": ("prefix_groups", _count(0)),
    "prefix": ("prefix_tokens", _count(0)),
    "priorities": ("priorities", _count(1)),
    "path": ("path", _path),
    "time_scale": ("time_scale", _pos("arrival-time multiplier")),
    "clients": ("clients", _count(1)),
    "think": ("think_s", _nonneg("seconds")),
    "seed": ("seed", _count(0)),
    "json": ("json_fraction", _fraction),
    "schema": ("schema_path", _path),
}
_JSON_KEYS = {"json", "schema", "seed"}
_SHAPE_KEYS = {"n", "duration", "prompt", "output", "prefix_groups", "prefix", "priorities"}
_SHAPE_KEYS |= _JSON_KEYS
_KIND_KEYS = {
    "poisson": _SHAPE_KEYS | {"rate"},
    "gamma": _SHAPE_KEYS | {"rate", "cv"},
    "trace": {"path", "time_scale", "n", "duration"} | _JSON_KEYS,
    "closed": _SHAPE_KEYS | {"clients", "think"},
}


def _split(text: str) -> list[str]:
    """Split on the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            break
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"traffic: unbalanced parentheses in {text!r}")
    return [*parts, text[start:]]


def parse_traffic(text: str) -> TrafficSpec:
    """Parse `KIND:key=value,...` (grammar in the module docstring) into a TrafficSpec;
    ValueError naming the key on anything unknown, missing or malformed."""
    kind, _, body = text.strip().partition(":")
    kind = kind.strip()
    if kind not in _KIND_KEYS:
        raise ValueError(f"traffic: unknown kind {kind!r}; expected one of {KINDS} in {text!r}")
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for item in _split(body) if body.strip() else []:
        key, eq, raw = (part.strip() for part in item.partition("="))
        if key not in _KIND_KEYS[kind]:
            known = ", ".join(sorted(_KIND_KEYS[kind]))
            raise ValueError(f"traffic: unknown key {key!r} for {kind} (keys: {known})")
        if not eq or key in seen:
            raise ValueError(f"traffic: {key!r} needs exactly one `{key}=value`")
        seen.add(key)
        name, parse = _KEYS[key]
        fields[name] = parse(key, raw)
    return TrafficSpec(kind, **fields)
