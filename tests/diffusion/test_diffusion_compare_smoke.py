"""benchmarks/diffusion_compare.py on the smallest tiny DiffusionGemma, one repeat: every
field the JSON report promises is there and consistent (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandem.testing.tiny_diffusion_gemma import DIFFUSION_GEMMA_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = {
    "max_denoising_steps": 2, "t_min": 0.4, "t_max": 0.8,
    "stability_threshold": 1, "confidence_threshold": 1e9,
}  # fmt: skip


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = ROOT / "benchmarks" / "diffusion_compare.py"
    spec = importlib.util.spec_from_file_location("diffusion_compare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["diffusion_compare"] = module
    spec.loader.exec_module(module)
    return module


def test_one_repeat_reports_every_field(bench: ModuleType) -> None:
    text, canvas = DIFFUSION_GEMMA_CONFIGS["window"]
    report = bench.run_benchmark(
        text, canvas, batches=(1, 2), requests={1: 1, 2: 2}, prompt_lengths=(3, 6),
        max_tokens=6, repeats=1, schedules={"adaptive": SCHEDULE},
    )  # fmt: skip
    report = json.loads(json.dumps(report))  # what the file holds
    rows = report["results"]
    assert [(r["schedule"], r["batch"], r["requests"]) for r in rows] == [
        ("adaptive", 1, 1),
        ("adaptive", 2, 2),
    ]
    for row in rows:
        assert row["committed_tokens_per_run"] == 6 * row["requests"]
        assert row["tandem_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert len(row["ratios"]) == 1 and row["ratio_tandem_over_transformers"] > 0
        assert 1 <= row["tandem_denoising_steps_per_canvas"] <= 2
        assert row["tandem_committed_tokens_per_step"] > 0
        assert row["tandem_tokens_per_forward"] > 0 and row["transformers_tokens_per_forward"] > 0
    profile = report["profiles"]["adaptive/batch2"]
    for side in ("tandem", "transformers"):
        assert 0 < profile[side]["forward_share"] <= 1 and profile[side]["top_own_time"]
        assert profile[side]["own_s_by_group"]["matmul"] > 0
    machine = report["machine"]
    assert len(machine["load_average"]) == 3 and machine["torch_threads"] == 1
    assert isinstance(machine["cpu"]["flags"], list)
    assert report["tandem_settings"]["executor"]
