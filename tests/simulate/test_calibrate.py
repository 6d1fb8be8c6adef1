"""`tandem simulate calibrate` and the `calibrated-cost` plugin: the non-negative fit, the
fit file, the plugin's answer, and a short real calibration on a tiny random model.
No test asserts a timing value: only structure, signs and orderings."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tandem.core.plugin_manager import TandemPluginManager
from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.calibrated import (
    CalibratedCostModel,
    CalibrationFit,
    load_fit,
    save_fit,
)
from tandem.plugins.cost_models.linear_fit import (
    FEATURES,
    FIT_FEATURES,
    TOKEN_SEGMENTS,
    fit_nonnegative,
    nnls,
    select,
    step_features,
    token_segments,
)
from tandem.schema.config import EngineConfig
from tandem.simulate.cli import main as simulate_main
from tandem.testing.engine import scripted_config

#: The features of a version-1 fit file (one slope per token), which still loads.
V1_FEATURES = ("const", "num_tokens", "num_reqs", "decode_kv", "prefill_attn", "num_sampled")
#: Known coefficients, one per `V1_FEATURES` entry (seconds per unit).
TRUE_COEF = (2e-3, 1.5e-4, 4e-5, 2e-7, 3e-8, 6e-4)


def random_shapes(count: int, seed: int = 0) -> list[StepShape]:
    """Prefills, decodes and mixed steps; num_sampled varies apart from num_reqs."""
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        decodes = rng.choice([0, 1, 4, 16, 64]) if i % 3 else 0
        prefills = rng.choice([0, 1, 2]) if decodes else rng.choice([1, 2])
        q = [1] * decodes + [rng.randint(2, 1024) for _ in range(prefills)]
        c = [rng.randint(16, 2048) for _ in range(decodes)]
        c += [rng.choice([0, 0, 512]) for _ in range(prefills)]
        shapes.append(StepShape(tuple(q), tuple(c), num_sampled=rng.randint(1, len(q))))
    return shapes


def row(step: StepShape, names: tuple[str, ...] = V1_FEATURES) -> list[float]:
    return select(step_features(step), names)


def formula(
    coef: tuple[float, ...], step: StepShape, names: tuple[str, ...] = V1_FEATURES
) -> float:
    return sum(k * f for k, f in zip(coef, row(step, names), strict=True))


def write_fit(path: Path, coef: tuple[float, ...] = TRUE_COEF, **extra: object) -> Path:
    fit = CalibrationFit(V1_FEATURES, coef, step_s=1e-3, per_request_s=2e-5, model="tiny")
    save_fit(fit, path)
    if extra:
        data = json.loads(path.read_text()) | extra
        path.write_text(json.dumps(data))
    return path


# The fit -------------------------------------------------------------------------------


def test_exactly_linear_timings_give_back_the_coefficients() -> None:
    shapes = random_shapes(80)
    rows = [row(s) for s in shapes]
    seconds = [formula(TRUE_COEF, s) for s in shapes]
    fit = fit_nonnegative(rows, seconds)
    assert fit.coef == pytest.approx(TRUE_COEF, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0) and fit.median_abs_rel_error < 1e-9
    assert fit.samples == 80


def test_coefficients_stay_non_negative_when_the_data_wants_a_negative_one() -> None:
    shapes = random_shapes(60, seed=1)
    wanted = (5e-3, 2e-4, -1e-4, 0.0, 1e-8, 1e-4)  # a negative per-request term
    seconds = [max(formula(wanted, s), 1e-4) for s in shapes]
    fit = fit_nonnegative([row(s) for s in shapes], seconds)
    assert all(c >= 0 for c in fit.coef)
    assert all(fit.predict(row(s)) >= 0 for s in shapes)


def test_nnls_meets_the_optimality_conditions() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        a, b = rng.normal(size=(25, 6)), rng.normal(size=25)
        x = nnls(a, b)
        gradient = a.T @ (b - a @ x)  # KKT: x >= 0, gradient <= 0, gradient = 0 where x > 0
        assert (x >= 0).all() and (gradient <= 1e-8).all()
        assert np.abs(gradient[x > 0]).max(initial=0.0) < 1e-8


def test_a_step_without_tokens_has_no_features() -> None:
    assert step_features(StepShape((), ())) == [0.0] * len(FEATURES)
    mixed = StepShape((1, 1, 100), (50, 70, 20), num_sampled=3)
    segments = [4.0, 12.0, 48.0, 38.0, 0.0, 0.0]  # 102 tokens over 0-4-16-64-256-1024-up
    assert step_features(mixed) == [1.0, 102.0, 3.0, 120.0, 100 * (20 + 50), 3.0, *segments]


def test_the_token_segments_sum_to_the_tokens_and_fill_in_order() -> None:
    assert len(token_segments(0)) == len(TOKEN_SEGMENTS)
    for tokens in (0, 1, 4, 5, 16, 100, 1024, 5000):
        parts = token_segments(tokens)
        assert sum(parts) == tokens and all(p >= 0 for p in parts)
        full = [i for i, p in enumerate(parts) if p > 0]
        assert full == list(range(len(full)))  # a segment fills only after the ones below


def test_a_piecewise_token_curve_is_recovered_by_the_segment_fit() -> None:
    """A linear-layer cost whose slope per token falls past 4 rows and rises past 256 (a
    register tile, then a panel path) is what one slope cannot follow and the segments can:
    the fit over `FIT_FEATURES` gives back the curve's coefficients exactly."""
    slopes = dict(zip(TOKEN_SEGMENTS, (3e-3, 1e-3, 1e-3, 1.5e-3, 2.5e-3, 2.5e-3), strict=True))
    true = {"const": 1e-2, "num_reqs": 1e-4, "decode_kv": 5e-6, "prefill_attn": 1e-7}
    true |= {"num_sampled": 0.0, **slopes}
    coef = tuple(true[name] for name in FIT_FEATURES)
    shapes = random_shapes(120, seed=4)
    seconds = [formula(coef, s, FIT_FEATURES) for s in shapes]
    fit = fit_nonnegative([row(s, FIT_FEATURES) for s in shapes], seconds)
    assert fit.coef == pytest.approx(coef, rel=1e-6, abs=1e-12)
    one_slope = fit_nonnegative([row(s) for s in shapes], seconds)
    assert one_slope.median_abs_rel_error > 100 * fit.median_abs_rel_error


# The plugin ----------------------------------------------------------------------------


def test_the_plugin_answers_the_fits_formula(tmp_path: Path) -> None:
    path = write_fit(tmp_path / "fit.json")
    plugin = CalibratedCostModel(EngineConfig(), CalibratedCostModel.Options(fit=str(path)))
    for step in random_shapes(20, seed=2):
        assert plugin.step_cost(step=step) == pytest.approx(formula(TRUE_COEF, step))
    assert plugin.step_cost(step=StepShape((), ())) == 0.0
    engine = load_fit(path).engine_time()
    assert (engine.mode, engine.step_s, engine.per_request_s) == ("modelled", 1e-3, 2e-5)


def test_the_plugin_runs_from_a_resolved_stack(tmp_path: Path) -> None:
    path = write_fit(tmp_path / "fit.json")
    cost = {"name": "calibrated-cost", "options": {"fit": str(path)}}
    config = scripted_config(plugins=["reference-scheduler", "default-sampler", cost])
    manager = TandemPluginManager(config, side="worker")
    step = StepShape((1, 1, 37), (10, 300, 0), num_sampled=3)
    assert manager.hook.step_cost(step=step) == pytest.approx(formula(TRUE_COEF, step))


@pytest.mark.parametrize(
    "content",
    [
        None,  # missing file
        "not json",
        json.dumps({"version": 2, "features": [], "coef": []}),
        json.dumps({"version": 1, "features": ["const"], "coef": [-1.0], "engine_time": {}}),
        json.dumps({"version": 1, "features": ["bogus"], "coef": [1.0]}),
        json.dumps({"version": 1, "features": ["const"], "coef": [1.0], "engine_time": None}),
    ],
)
def test_a_missing_or_bad_fit_is_a_value_error_naming_fit(tmp_path: Path, content: str) -> None:
    path = tmp_path / "fit.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="fit"):
        CalibratedCostModel(EngineConfig(), CalibratedCostModel.Options(fit=str(path)))
    bad = {"name": "calibrated-cost", "options": {"fit": str(path)}}
    config = scripted_config(plugins=["reference-scheduler", "default-sampler", bad])
    with pytest.raises(ValueError, match="fit"):
        TandemPluginManager(config, side="worker")


def test_a_step_on_another_parallel_layout_is_refused(tmp_path: Path) -> None:
    path = write_fit(tmp_path / "fit.json", stack={"tensor_parallel_size": 1})
    plugin = CalibratedCostModel(EngineConfig(), CalibratedCostModel.Options(fit=str(path)))
    assert plugin.step_cost(step=StepShape((1,), (10,), 1)) > 0
    with pytest.raises(ValueError, match="fit.*tensor/pipeline"):
        plugin.step_cost(step=StepShape((1,), (10,), 1, tensor_parallel_size=2))


def test_tandem_simulate_uses_a_stack_naming_the_calibrated_model(tmp_path: Path) -> None:
    fit = write_fit(tmp_path / "fit.json")
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "scheduler: {max_num_seqs: 16, async_scheduling: false}\n"
        f"plugins: [reference-scheduler, default-sampler, {{name: calibrated-cost, options: "
        f"{{fit: '{fit}'}}}}]\n"
    )
    out = tmp_path / "sim.json"
    argv = ["--stack", str(stack), "--quiet", "--max-model-len", "1024", "--out", str(out)]
    argv += ["--traffic", "poisson:rate=2,n=12,prompt=uniform(16,64),output=uniform(4,16)"]
    argv += ["--engine-time", "modelled:step=0.001,per_request=0.00002"]
    assert simulate_main(argv) == 0
    summary = json.loads(out.read_text())["stacks"]["stack"]
    assert summary["completed"] == 12 and summary["device_busy_fraction"] > 0


# A real calibration --------------------------------------------------------------------


def test_a_short_calibration_of_a_tiny_model_writes_a_usable_fit(
    tiny_model_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # noqa: ANN001
    stack = tmp_path / "tiny.yaml"
    stack.write_text(
        f"model: {{model: '{tiny_model_dir('llama')}'}}\n"
        "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 512}\n"
    )
    out = tmp_path / "fit.json"
    argv = ["calibrate", "--config", str(stack), "--max-seconds", "20", "--threads", "1"]
    assert simulate_main([*argv, "--repeats", "2", "--out", str(out), "--quiet"]) == 0
    assert "r2" in capsys.readouterr().out
    fit = load_fit(out)
    assert fit.features == FIT_FEATURES and fit.samples >= 2 and all(c >= 0 for c in fit.coef)
    assert fit.stack["executor"] and fit.stack["max_num_batched_tokens"] == 512
    assert fit.extra["points"] and fit.step_s >= 0 and fit.per_request_s >= 0
    prefills = [fit.device_seconds(StepShape((n,), (0,), 1)) for n in (16, 64, 256, 500)]
    assert all(p > 0 for p in prefills)
    assert prefills == sorted(prefills) and prefills[-1] > prefills[0]
    decodes = [fit.device_seconds(StepShape((1,) * b, (100,) * b, b)) for b in (1, 4, 16)]
    assert all(d > 0 for d in decodes) and decodes == sorted(decodes)


def test_a_count_weighs_a_row_as_that_many_copies_of_it() -> None:
    rng = random.Random(3)
    rows = [[1.0, rng.uniform(1, 100), rng.uniform(0, 50)] for _ in range(12)]
    seconds = [0.01 + 1e-4 * r[1] + 3e-4 * r[2] + rng.uniform(-2e-3, 2e-3) for r in rows]
    counts = [rng.randint(1, 4) for _ in rows]
    copies = [(r, s) for r, s, n in zip(rows, seconds, counts, strict=True) for _ in range(n)]
    repeated = fit_nonnegative([r for r, _ in copies], [s for _, s in copies])
    weighted = fit_nonnegative(rows, seconds, counts=counts)
    np.testing.assert_allclose(weighted.coef, repeated.coef, rtol=1e-6, atol=1e-12)
    unweighted = fit_nonnegative(rows, seconds)
    assert not np.allclose(unweighted.coef, repeated.coef, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("counts", [[1.0, 0.0], [1.0], [1.0, float("nan")]])
def test_bad_counts_are_refused(counts: list[float]) -> None:
    with pytest.raises(ValueError, match="counts"):
        fit_nonnegative([[1.0, 2.0], [1.0, 3.0]], [0.1, 0.2], counts=counts)


def test_traffic_points_count_their_steps_and_grid_points_once() -> None:
    from tandem.simulate.calibrate import TRAFFIC_LABEL, GridPoint, point_weight

    features = tuple(float(i) for i in range(len(FEATURES)))
    grid = GridPoint("decode:4:64", 4, 4, features, 0.03, 0.001, 0.031, 3)
    traffic = GridPoint(f"{TRAFFIC_LABEL}0", 4, 4, features, 0.03, 0.001, 0.031, 250)
    assert point_weight(grid) == 1.0 and point_weight(traffic) == 250.0


def test_a_bad_traffic_spec_fails_before_the_model_loads(tmp_path: Path) -> None:
    argv = ["calibrate", "--out", str(tmp_path / "fit.json"), "--max-seconds", "5"]
    with pytest.raises(ValueError, match="traffic"):
        simulate_main([*argv, "--traffic", "nope:1"])


def test_replayed_traffic_runs_every_request_and_times_its_steps(tiny_model_dir) -> None:  # noqa: ANN001
    from tandem.config_resolution import resolve_config
    from tandem.core.engine_core import EngineCore
    from tandem.simulate.trace_profile import replay_steps
    from tandem.simulate.traffic import TrafficRequest
    from tandem.stack_file import load_config

    config = resolve_config(
        load_config(
            None,
            model=str(tiny_model_dir("llama")),
            async_scheduling=False,
            worker_num_threads=1,
            enable_prefix_caching=False,
        )
    )
    traffic = [TrafficRequest(0.02 * i, 10 + 7 * i, 3 + i % 4) for i in range(6)]
    engine = EngineCore(config, source="test")
    try:
        lines: list[str] = []
        samples = replay_steps(engine, traffic, seed=5, label="traffic:0", log=lines.append)
        assert not engine.has_work()
    finally:
        engine.shutdown()
    assert samples and all(s.label == "traffic:0" for s in samples)
    assert all(s.wall_s >= s.device_s > 0 for s in samples)
    prompt_tokens = sum(s.shape.num_prefill_tokens for s in samples)
    decode_tokens = sum(s.shape.num_tokens - s.shape.num_prefill_tokens for s in samples)
    assert prompt_tokens == sum(t.prompt_tokens for t in traffic)
    # Each request samples its first token after its prefill; the rest are decode steps.
    assert decode_tokens == sum(t.output_tokens - 1 for t in traffic)
    assert lines == [f"traffic:0: 6 requests, {len(samples)} steps replayed"]


# Merging calibrations -------------------------------------------------------------------


def _fit_with_points(seconds_per_token: float, stack: dict | None = None) -> CalibrationFit:
    """A fit file's contents whose points are prefills and decodes costing exactly
    2 ms + `seconds_per_token` x tokens (as `calibrate` records them)."""
    from dataclasses import asdict

    from tandem.plugins.cost_models.linear_fit import step_features
    from tandem.simulate.calibrate import GridPoint

    points = []
    for label, shape in [(f"prefill:{n}", StepShape((n,), (0,), 1)) for n in (8, 32, 128, 512)] + [
        (f"decode:{b}:64", StepShape((1,) * b, (64,) * b, b)) for b in (1, 4, 16, 64)
    ]:
        seconds = 0.002 + seconds_per_token * shape.num_tokens
        row = tuple(step_features(shape))
        points.append(
            asdict(
                GridPoint(label, shape.num_reqs, shape.num_tokens, row, seconds, 1e-4, seconds, 3)
            )
        )
    return CalibrationFit.from_json(
        {
            "version": 1,
            "features": list(FIT_FEATURES),
            "coef": [0.0] * len(FIT_FEATURES),
            "engine_time": {"step_s": 1e-4, "per_request_s": 0.0},
            "device": "cpu",
            "model": "m",
            "stack": stack or {"max_num_seqs": 64},
            "steps": 24,
            "points": points,
        }
    )


def test_merging_two_calibrations_refits_the_union_of_their_points(tmp_path: Path) -> None:
    from tandem.simulate.calibrate import merge_fits

    slow, fast = _fit_with_points(2e-3), _fit_with_points(1e-3)
    merged, points = merge_fits([slow, fast])
    assert len(points) == 16 and merged.extra["steps"] == 48
    assert len(merged.extra["points"]) == 16 and len(merged.extra["profile"]) == 2
    for tokens in (8, 32, 128, 512):  # between the two calibrations' exact costs
        shape = StepShape((tokens,), (0,), 1)
        price = merged.device_seconds(shape)
        assert 0.002 + 1e-3 * tokens < price < 0.002 + 2e-3 * tokens
    alone, _ = merge_fits([slow, slow])  # the same points twice: the same exact fit
    assert alone.device_seconds(StepShape((100,), (0,), 1)) == pytest.approx(0.202, rel=1e-6)
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for fit, path in zip((slow, fast), paths, strict=True):
        save_fit(fit, path)
    out = tmp_path / "merged.json"
    argv = ["calibrate", "--merge", *map(str, paths), "--out", str(out), "--quiet"]
    assert simulate_main(argv) == 0
    assert load_fit(out).coef == pytest.approx(merged.coef, rel=1e-9, abs=1e-15)


def test_merging_refuses_other_stacks_missing_points_and_profiling_flags(tmp_path: Path) -> None:
    from tandem.simulate.calibrate import merge_fits

    base = _fit_with_points(1e-3)
    with pytest.raises(ValueError, match="merge: fit 1 was measured on another stack"):
        merge_fits([base, _fit_with_points(1e-3, {"max_num_seqs": 8})])
    bare = CalibrationFit.from_json(base.to_json() | {"points": []})
    with pytest.raises(ValueError, match="merge: fit 1 records no points"):
        merge_fits([base, bare])
    with pytest.raises(ValueError, match="at least two"):
        merge_fits([base])
    path = tmp_path / "a.json"
    save_fit(base, path)
    with pytest.raises(ValueError, match="--merge"):
        simulate_main(["calibrate", "--merge", str(path), str(path), "--traffic", "x"])
