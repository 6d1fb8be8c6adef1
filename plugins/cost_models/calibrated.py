"""A cost model fitted to this device's measured steps, and its plugin (`calibrated-cost`).

`tandem simulate calibrate` times the real engine's steps over a grid of batch shapes and
writes a fit file (JSON, an operator's file):

    {"version": 1,
     "features": ["const", "num_tokens", ...],   # names from linear_fit.FEATURES
     "coef": [...],                              # seconds per unit of each feature, >= 0
     "engine_time": {"step_s": .., "per_request_s": .., ...},
     "device": "<cpu model and flags>", "model": "<model path>", "stack": {...},
     "samples": N, "r2": .., "median_abs_rel_error": .., ...}

`coef` prices the device part of a step (the executor's execute + sample), `engine_time`
the engine's own CPU time per step (`step_s` + `per_request_s` x scheduled requests, the
`EngineTime` the simulated device charges). `r2` and `median_abs_rel_error` describe the
device fit on its own samples. Other keys are kept and ignored. The fit holds for the
device, model, threads and stack it was measured on; nothing checks that they match the
simulated stack except the parallel layout of each step priced (`stack.tensor_parallel_size`
/ `stack.pipeline_parallel_size`, when the file records them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.linear_fit import FEATURES, step_features
from tandem.schema.config import EngineConfig

if TYPE_CHECKING:  # the simulated device is imported where a simulation runs
    from tandem.core.worker.virtual_device import EngineTime

FIT_VERSION = 1
_INDEX = {name: i for i, name in enumerate(FEATURES)}


@dataclass(frozen=True, slots=True)
class CalibrationFit:
    """A fit file's contents. `coef[i]` is the seconds per unit of `features[i]` (a subset
    of `FEATURES`, any order); `step_s` / `per_request_s` the engine's CPU seconds per step
    and per scheduled request. `extra` holds the file's other keys."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    step_s: float
    per_request_s: float
    device: str = ""
    model: str = ""
    stack: dict[str, Any] = field(default_factory=dict)
    samples: int = 0
    r2: float = math.nan
    median_abs_rel_error: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)

    def device_seconds(self, step: StepShape) -> float:
        """Seconds of the device part of `step` (>= 0; 0.0 for a step without tokens)."""
        values = step_features(step)
        return sum(
            c * values[_INDEX[name]] for name, c in zip(self.features, self.coef, strict=True)
        )

    def engine_time(self) -> EngineTime:
        """The modelled engine CPU time of the fit (`EngineTime(mode="modelled")`)."""
        from tandem.core.worker.virtual_device import EngineTime

        return EngineTime("modelled", step_s=self.step_s, per_request_s=self.per_request_s)

    def to_json(self) -> dict[str, Any]:
        """The file's JSON object (version 1)."""
        engine = dict(self.extra.get("engine_time", {}))
        engine |= {"step_s": self.step_s, "per_request_s": self.per_request_s}
        extra = {k: v for k, v in self.extra.items() if k != "engine_time"}
        return {
            "version": FIT_VERSION,
            "features": list(self.features),
            "coef": list(self.coef),
            "engine_time": engine,
            "device": self.device,
            "model": self.model,
            "stack": self.stack,
            "samples": self.samples,
            "r2": self.r2,
            "median_abs_rel_error": self.median_abs_rel_error,
            **extra,
        }

    @classmethod
    def from_json(cls, data: Any) -> CalibrationFit:
        """Validate a fit file's object; ValueError saying which key is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("version") != FIT_VERSION:
            raise ValueError(f"version: expected {FIT_VERSION}, got {data.get('version')!r}")
        features, coef = data.get("features"), data.get("coef")
        if not isinstance(features, list) or not isinstance(coef, list):
            raise ValueError("features and coef must be lists")
        unknown = [f for f in features if f not in _INDEX]
        if unknown or len(set(features)) != len(features):
            raise ValueError(
                f"features: unknown or repeated {unknown or features}; known: {FEATURES}"
            )
        if len(coef) != len(features) or not all(_non_negative(c) for c in coef):
            raise ValueError("coef: expected one finite number >= 0 per feature")
        engine = data.get("engine_time")
        if not isinstance(engine, dict) or not all(
            _non_negative(engine.get(k)) for k in ("step_s", "per_request_s")
        ):
            raise ValueError("engine_time: expected {step_s, per_request_s}, numbers >= 0")
        known = {"version", "features", "coef", "device", "model", "stack", "samples"}
        known |= {"r2", "median_abs_rel_error"}
        return cls(
            features=tuple(features),
            coef=tuple(float(c) for c in coef),
            step_s=float(engine["step_s"]),
            per_request_s=float(engine["per_request_s"]),
            device=str(data.get("device", "")),
            model=str(data.get("model", "")),
            stack=dict(data.get("stack") or {}),
            samples=int(data.get("samples", 0)),
            r2=float(data.get("r2", math.nan)),
            median_abs_rel_error=float(data.get("median_abs_rel_error", math.nan)),
            extra={k: v for k, v in data.items() if k not in known},
        )


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def load_fit(path: str | Path) -> CalibrationFit:
    """The fit file at `path`; ValueError naming `fit` and the file when it cannot be read
    or is not a valid fit."""
    path = Path(path).expanduser()
    try:
        return CalibrationFit.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"fit: cannot read a calibration fit from {path}: {exc}") from exc


def save_fit(fit: CalibrationFit, path: str | Path) -> None:
    """Write `fit` as JSON (indented) to `path`."""
    Path(path).write_text(json.dumps(fit.to_json(), indent=1) + "\n")


class CalibratedCostModel(TandemPlugin):
    """The `step_cost` answer of a calibration fit (`tandem simulate calibrate`): the fitted
    linear function of the step's shape (`CalibrationFit.device_seconds`), in seconds.

    Option `fit`: the path of the fit file. A missing or invalid file is a ValueError
    naming `fit` when the plugin is built; a step on another parallel layout than the fit
    was measured on, one when it is priced. The fit's engine time is not applied by the plugin: pass
    `load_fit(path).engine_time()` to the simulation (`engine_time=`).
    """

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fit: str = Field(description="path of a fit file written by `tandem simulate calibrate`")

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, CalibratedCostModel.Options)
        self.fit = load_fit(options.fit)
        stack = self.fit.stack
        self.layout = (stack.get("tensor_parallel_size"), stack.get("pipeline_parallel_size"))

    @hookimpl
    def step_cost(self, step: StepShape) -> float | None:
        """Seconds the device takes for `step` according to the fit (>= 0). A step priced
        on another parallel layout than the fit was measured on (when the file records
        it) is a ValueError naming `fit`: the fit knows nothing of other layouts."""
        tp, pp = self.layout
        if (tp is not None and tp != step.tensor_parallel_size) or (
            pp is not None and pp != step.pipeline_parallel_size
        ):
            raise ValueError(
                f"fit: {self.options.fit} was measured with tensor/pipeline parallel sizes "
                f"{tp}/{pp}, the step has {step.tensor_parallel_size}/"
                f"{step.pipeline_parallel_size}; calibrate on that layout"
            )
        return self.fit.device_seconds(step)
