"""`tandem bench` with a failing peer exits non-zero and prints the peer's error (it used to
print `null` figures and exit 0); `--set` may override the bench's own LLM keywords
(`trace_hooks`) instead of colliding with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import main as bench_main
from tandem.bench import run_tandem


def test_a_failing_peer_makes_bench_exit_non_zero_with_its_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The built-in workload's token ids (up to 40000) are outside the scripted vocabulary.
    out = tmp_path / "bench.json"
    rc = bench_main(
        ["--workload", "small", "--model", "scripted", "--peers", "tandem", "--out", str(out)]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "peer 'tandem' failed" in err and "vocab" in err
    result = json.loads(out.read_text())
    assert "error" in result["peers"]["tandem"]["runs"][0]


def test_set_overrides_the_bench_keywords_instead_of_colliding() -> None:
    workload = {"name": "tiny", "requests": [{"prompt_token_ids": [5, 6, 7], "max_tokens": 3}]}
    result = run_tandem(workload, "scripted", 1, {"trace_hooks": False})
    assert result["output_tokens"] == 3 and result["hook_times"] == {}
