"""Against Vidur: one trace, one model, one device through Vidur and through `tandem simulate`.

Vidur (MLSys'24, PyPI `vidur==0.0.26`, `benchmarks/peers/setup_vidur.sh`) is a discrete-event
simulator of LLM serving whose step times come from per-operator GPU profiles (MLP/linear ops
and attention kernels measured on the device, interpolated by a random forest). This script
writes one seeded trace, replays it at each rate through

- `tandem simulate` (the repo's own CLI, the real reference-scheduler plugin objects, the
  `roofline-cost` model for `--model llama-3-8b --device DEV`): `examples/simulate/fcfs-sync.yaml`
  as deployed (engine CPU time modelled, the CLI default), the same with zero engine CPU time
  (Vidur charges none), and `fcfs-async.yaml`;
- Vidur (`python -m vidur.main` in its own venv): its `vllm` replica scheduler (vLLM v0:
  whole-prompt prefill batches, decodes only when no prefill can be admitted) and its `sarathi`
  scheduler (chunked prefill piggybacked on decodes under one token budget, which is what
  vLLM V1 and tandem's reference scheduler do),

with the same limits (256 sequences, 8192 batched tokens / chunk, block size 16, the KV pool
tandem sizes for the device at 90 % memory, TP 1), and writes
`benchmarks/results/simulate_vidur.json`: per setup and rate, per simulator TTFT p50/p90,
TPOT p50/p90, E2E p50, requests/s and output tokens/s, the wall time of the run, and the
ratios tandem / Vidur.

Vidur's metrics are read from its `request_metrics.csv`: TTFT = `prefill_e2e_time` (prefill
completion - arrival; Vidur's prefill emits the first token), E2E = `request_e2e_time`, and
TPOT = `decode_time_execution_plus_preemption_normalized` x D / (D - 1): Vidur divides the
decode span (completion - prefill completion) by all D output tokens, tandem by the D - 1 gaps
after the first token, so the column is rescaled to tandem's definition. Percentiles use
tandem's own function (`tandem.bench_serve_report.stats_ms`); throughput is completed requests
(and their output tokens) over the time the last one finished, as tandem's report counts it.

Profiles. Vidur 0.0.26 fetches its profiles from Hugging Face datasets at run time (see
setup_vidur.sh); here they are laid into an offline HF cache (`HF_HUB_OFFLINE=1`) from

- `--vidur-data DIR`: Vidur's own profiles (mlp/attention .csv or .csv.xz somewhere under DIR);
- otherwise a profile *generated from tandem's roofline*, op by op, on the grids Vidur's own
  profiler sweeps (`roofline_mlp_rows`, `roofline_attention_rows`); `--a100-mlp-profile CSV`
  adds an A100 setup whose linear ops come from a measured Vidur `mlp.csv` (attention stays
  roofline).

The JSON records which. `step_check` replays Vidur's batches of the top rate through
both cost models. Run (about 7 minutes on 2 shared cores; the first Vidur run on a profile
trains its random forests, 40-80 s, cached in the venv after):

    bash benchmarks/peers/setup_vidur.sh
    .venv/bin/python benchmarks/simulate_vidur.py \\
        --a100-mlp-profile /tmp/vidur-data/a100_llama3_8b_mlp.csv [--vidur-data DIR]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tandem.bench_serve_report import stats_ms
from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.roofline import CostFactors, breakdown
from tandem.plugins.cost_models.shapes import device_spec, model_shape

ROOT = Path(__file__).resolve().parent.parent
VIDUR_VENV = ROOT / "benchmarks/peers/.venv-vidur"
DEFAULT_OUT = ROOT / "benchmarks/results/simulate_vidur.json"

MODEL = "llama-3-8b"
VIDUR_MODEL = "meta-llama/Llama-3-8B"
MAX_MODEL_LEN = 4096  # Vidur's Llama-3-8B config caps requests at 4096 tokens
MAX_NUM_SEQS = 256
MAX_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16
NETWORK_DEVICE = {"h100": "h100_dgx", "a100": "a100_dgx"}
TRACE_DATE = "2024-01-01"  # Vidur's trace replay keeps the rows of one `Date`

# The op names of Vidur's mlp.csv / attention.csv (time_stats.<op>.median, ms per layer).
MLP_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
ATTENTION_OPS = (
    "attn_input_reshape",
    "attn_kv_cache_save",
    "attn_prefill",
    "attn_decode",
    "attn_output_reshape",
)
STAT_KINDS = ("min", "max", "mean", "median", "std")


# ----------------------------------------------------------------------------- the trace


def make_trace(n: int, seed: int) -> list[dict[str, float]]:
    """n requests: unit-rate Poisson arrivals (scaled per rate later), prompts
    lognormal(mean 1024, sigma 0.8) in [16, 3072], outputs lognormal(mean 256, sigma 0.7) in
    [2, 1024] (two tokens at least, so every request has a TPOT)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)

    def lognormal(mean: float, sigma: float, lo: int, hi: int) -> np.ndarray:
        mu = math.log(mean) - sigma**2 / 2
        return np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi).astype(int)

    prompts = lognormal(1024, 0.8, 16, 3072)
    outputs = lognormal(256, 0.7, 2, 1024)
    return [
        {"arrival": float(a), "prompt": int(p), "output": int(o)}
        for a, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]


def write_traces(trace: list[dict[str, float]], rate: float, folder: Path) -> tuple[Path, Path]:
    """The trace at `rate` req/s as tandem JSONL and as Vidur's trace-replay CSV."""
    folder.mkdir(parents=True, exist_ok=True)
    tandem_path, vidur_path = folder / f"trace-{rate:g}.jsonl", folder / f"trace-{rate:g}.csv"
    with tandem_path.open("w") as f:
        for r in trace:
            row = {
                "arrival_s": r["arrival"] / rate,
                "prompt_tokens": r["prompt"],
                "output_tokens": r["output"],
            }
            f.write(json.dumps(row) + "\n")
    with vidur_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in trace:
            w.writerow([TRACE_DATE, repr(r["arrival"] / rate), r["prompt"], r["output"]])
    return tandem_path, vidur_path


# ------------------------------------------------------------ profiles from tandem's roofline


def _vidur_num_tokens(max_tokens: int) -> list[int]:
    """The token counts Vidur's MLP profiler sweeps (vidur.profiling.utils), up to max_tokens."""
    space = (
        [1, 2, 4]
        + list(range(8, 1024, 8))
        + list(range(1024, 2048 + 1, 16))
        + list(range(2048, 4096 + 1, 32))
        + list(range(4096, 8192 + 1, 64))
    )
    return sorted({t for t in space if t <= max_tokens})


def _vidur_seq_lengths(max_seq_len: int) -> list[int]:
    space = list(range(0, 1024 + 1, 32)) + list(range(1024, 4096 + 1, 64))
    space += list(range(4096, 65536 + 1, 256))
    return sorted({s for s in space if s < max_seq_len})


def _vidur_chunk_sizes(max_seq_len: int, max_chunk: int) -> list[int]:
    space = list(range(32, 128 + 1, 32)) + list(range(256, 1024 + 1, 128))
    space += list(range(1024, 8192 + 1, 512))
    return sorted({c for c in space if c <= max_seq_len and c <= max_chunk})


def _vidur_batch_sizes(max_batch: int) -> list[int]:
    return sorted({b for b in list(range(1, 129)) + list(range(128, 1025, 8)) if b <= max_batch})


def _stat_cells(prefix: str, ms: float) -> dict[str, float]:
    return {f"time_stats.{prefix}.{k}": (0.0 if k == "std" else ms) for k in STAT_KINDS}


def linear_op_params(device_model: str = MODEL) -> dict[str, float]:
    """Parameters of one layer's linear ops in Vidur's split (q/k/v, o, gate+up, down)."""
    s = model_shape(device_model)
    hd = s.head_dim or s.hidden_size // s.num_attention_heads
    ops = {
        "attn_pre_proj": s.hidden_size * (s.num_attention_heads + 2 * s.num_key_value_heads) * hd,
        "attn_post_proj": s.num_attention_heads * hd * s.hidden_size,
        "mlp_up_proj": s.hidden_size * 2 * s.intermediate_size,
        "mlp_down_proj": s.intermediate_size * s.hidden_size,
    }
    assert math.isclose(sum(ops.values()) * s.num_hidden_layers, s.layer_params())
    return ops


def roofline_linear_ms(device: str, op_params: float, tokens: int) -> float:
    """One op of one layer: max(FLOPs at mfu, weight bytes at bandwidth_efficiency), in ms; the
    same terms as roofline-cost's `linear` phase (whose sum over ops it reproduces, the LM head
    aside: every op has the same compute/memory crossover)."""
    d, f, s = device_spec(device), CostFactors(), model_shape(MODEL)
    compute = 2 * op_params * tokens / (d.peak_flops * f.mfu)
    memory = op_params * s.dtype_bytes / (d.mem_bandwidth * f.bandwidth_efficiency)
    return 1e3 * max(compute, memory)


def roofline_attention_ms(
    device: str, query_lens: tuple[int, ...], context_lens: tuple[int, ...]
) -> float:
    """roofline-cost's `attention` phase for the batch, per layer, in ms."""
    s, d = model_shape(MODEL), device_spec(device)
    step = StepShape(query_lens, context_lens, 0)
    return 1e3 * breakdown(s, d, step)["attention"] / s.num_hidden_layers


def roofline_mlp_rows(device: str, max_tokens: int) -> list[dict[str, Any]]:
    """Vidur mlp.csv rows for Llama-3-8B, TP 1: the four linear ops priced by the roofline,
    the element-wise ops (norms, rope, activation, add, embedding) 0 as in roofline-cost."""
    s = model_shape(MODEL)
    params = linear_op_params()
    rows = []
    for t in _vidur_num_tokens(max_tokens):
        row: dict[str, Any] = {}
        for op in MLP_OPS:
            row |= _stat_cells(
                op, roofline_linear_ms(device, params[op], t) if op in params else 0.0
            )
        row |= {
            "n_head": s.num_attention_heads,
            "n_kv_head": s.num_key_value_heads,
            "n_embd": s.hidden_size,
            "n_expanded_embd": s.intermediate_size,
            "vocab_size": s.vocab_size,
            "use_gated_mlp": True,
            "num_tokens": t,
            "num_tensor_parallel_workers": 1,
        }
        rows.append(row)
    return rows


def roofline_attention_rows(
    device: str, max_seq_len: int, max_chunk: int, max_batch: int, pool_tokens: int
) -> list[dict[str, Any]]:
    """Vidur attention.csv rows (the inputs Vidur's attention profiler sweeps: chunked and full
    prefills of one request, decode batches of equal context; batch x tokens within the KV
    pool) priced by roofline-cost's attention phase, one layer."""
    s = model_shape(MODEL)
    combos: list[tuple[int, int, int, bool]] = []
    for c in _vidur_chunk_sizes(max_seq_len, max_chunk):
        combos += [(c, i * c, 1, True) for i in range(max_seq_len // c)]
    if max_seq_len <= max_chunk:
        combos += [(q, 0, 1, True) for q in _vidur_seq_lengths(max_seq_len)]
    combos += [
        (0, k, b, False)
        for k in _vidur_seq_lengths(max_seq_len)
        for b in _vidur_batch_sizes(max_batch)
    ]
    rows, seen = [], set()
    for chunk, kv, batch, is_prefill in combos:
        valid = (chunk > 0 and chunk + kv <= max_seq_len) if is_prefill else (0 < kv <= max_seq_len)
        if not valid or batch * (kv + chunk) > pool_tokens or (chunk, kv, batch) in seen:
            continue
        seen.add((chunk, kv, batch))
        if is_prefill:
            prefill, decode = roofline_attention_ms(device, (chunk,), (kv,)), 0.0
        else:
            prefill, decode = 0.0, roofline_attention_ms(device, (1,) * batch, (kv,) * batch)
        row: dict[str, Any] = {}
        for op in ATTENTION_OPS:
            row |= _stat_cells(op, {"attn_prefill": prefill, "attn_decode": decode}.get(op, 0.0))
        row |= {
            "n_embd": s.hidden_size,
            "n_q_head": s.num_attention_heads,
            "n_kv_head": s.num_key_value_heads,
            "block_size": BLOCK_SIZE,
            "num_tensor_parallel_workers": 1,
            "max_model_len": max_seq_len,
            "batch_size": batch,
            "prefill_chunk_size": chunk,
            "kv_cache_size": kv,
            "is_prefill": is_prefill,
            "attention_backend": "tandem-roofline",
        }
        rows.append(row)
    return rows


def _network_rows(collective: str) -> list[dict[str, Any]]:
    """A placeholder network profile: Vidur's loader needs the files, but with TP 1 and one
    pipeline stage it never reads them."""
    return [
        _stat_cells(collective, 0.01)
        | {
            "rank": 0,
            "num_workers": 2,
            "size": 2048,
            "collective": collective,
            "devices_per_node": 2,
            "max_devices_per_node": 8,
        }
    ]


def _write_csv_xz(rows: list[dict[str, Any]], path: Path) -> None:
    with lzma.open(path, "wt", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _copy_as_xz(src: Path, dst: Path) -> None:
    if src.suffix == ".xz":
        shutil.copyfile(src, dst)
    else:
        with src.open("rb") as i, lzma.open(dst, "wb") as o:
            shutil.copyfileobj(i, o)


def _find(root: Path, name: str) -> Path | None:
    hits = sorted(p for p in root.rglob(f"{name}.csv*") if p.suffix in (".csv", ".xz"))
    return hits[0] if hits else None


def hf_dataset(
    cache_dir: Path, prefix: str, files: dict[str, Path | list[dict[str, Any]]], config: dict
) -> str:
    """Lay a dataset into `cache_dir` the way huggingface_hub's cache holds one, so that
    snapshot_download(repo_id, repo_type="dataset", cache_dir=cache_dir) finds it offline.
    The repo id is `prefix` plus a hash of the content: Vidur keys its cache of trained
    predictors by the dataset's name, so new content must get a new name."""
    staging = cache_dir / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, sort_keys=True))
    for name, content in files.items():
        if isinstance(content, Path):
            _copy_as_xz(content, staging / f"{name}.csv.xz")
        else:
            _write_csv_xz(content, staging / f"{name}.csv.xz")
    digest = hashlib.sha1()
    for f in sorted(staging.iterdir()):
        digest.update(f.name.encode())
        digest.update(lzma.decompress(f.read_bytes()) if f.suffix == ".xz" else f.read_bytes())
    repo_id = f"{prefix}-{digest.hexdigest()[:8]}"
    repo = cache_dir / ("datasets--" + repo_id.replace("/", "--"))
    shutil.rmtree(repo, ignore_errors=True)
    commit = digest.hexdigest()
    (repo / "snapshots").mkdir(parents=True)
    staging.rename(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo_id


def prepare_profiles(
    device: str, cache: Path, pool_tokens: int, vidur_data: Path | None, mlp_profile: Path | None
) -> tuple[str, str, str]:
    """Lay the compute and network datasets; returns their repo ids and a description."""
    compute_id = f"tandem-bench/{device}-llama-3-8b"
    network_id = f"tandem-bench/{NETWORK_DEVICE[device]}"
    compute_files: dict[str, Any] = {}
    network_files: dict[str, Any] = {}
    source = []
    if vidur_data is not None:
        mlp, attention = _find(vidur_data, "mlp"), _find(vidur_data, "attention")
        if mlp is None or attention is None:
            raise SystemExit(
                f"--vidur-data {vidur_data}: no mlp.csv[.xz] and attention.csv[.xz] under it"
            )
        compute_files = {"mlp": mlp, "attention": attention}
        source.append(f"Vidur's measured profiles ({mlp}, {attention})")
        for name in ("all_reduce", "send_recv"):
            found = _find(vidur_data, name)
            network_files[name] = found if found else _network_rows(name)
    else:
        if mlp_profile is not None:
            compute_files["mlp"] = mlp_profile
            source.append(f"linear ops: Vidur's measured {device} profile ({mlp_profile.name})")
        else:
            compute_files["mlp"] = roofline_mlp_rows(device, MAX_BATCHED_TOKENS)
            source.append("linear ops: tandem roofline")
        compute_files["attention"] = roofline_attention_rows(
            device, MAX_MODEL_LEN * 2, MAX_BATCHED_TOKENS, MAX_NUM_SEQS, pool_tokens
        )
        source.append("attention: tandem roofline")
        network_files = {n: _network_rows(n) for n in ("all_reduce", "send_recv")}
    compute_id = hf_dataset(
        cache / "profiling_data/compute",
        compute_id,
        compute_files,
        {"model": VIDUR_MODEL, "device_sku": device},
    )
    network_id = hf_dataset(
        cache / "profiling_data/network", network_id, network_files, {"sku": NETWORK_DEVICE[device]}
    )
    return compute_id, network_id, "; ".join(source)


# ----------------------------------------------------------------------------- runners


def tandem_kv_blocks(device: str) -> int:
    """The pool `tandem simulate` gives a stack without cache.num_kv_blocks (cli.kv_blocks)."""
    from tandem.simulate.cli import kv_blocks

    args = argparse.Namespace(device=device, model=MODEL, model_config=None, tp=1, pp=1)
    return kv_blocks(args, BLOCK_SIZE)


def run_tandem(stack: str, trace: Path, device: str, out: Path, engine_time: str | None) -> dict:
    cmd = [
        str(ROOT / ".venv/bin/tandem"),
        "simulate",
        "--stack",
        str(ROOT / stack),
        "--traffic",
        f"trace:path={trace}",
        "--model",
        MODEL,
        "--device",
        device,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--out",
        str(out),
        "--quiet",
    ]
    if engine_time:
        cmd += ["--engine-time", engine_time]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    (summary,) = json.loads(out.read_text())["stacks"].values()
    return {
        "ttft_ms": {k: summary["ttft_ms"][k] for k in ("p50", "p90")},
        "tpot_ms": {k: summary["tpot_ms"][k] for k in ("p50", "p90")},
        "e2e_ms": {"p50": summary["e2e_ms"]["p50"]},
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
        "completed": summary["completed"],
        "num_preemptions": summary["num_preemptions"],
        "duration_s": summary["duration_s"],
        "wall_s": wall,
        "wall_s_simulation": summary["wall_s"],
        "command": " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
    }


def vidur_args(
    scheduler: str,
    trace: Path,
    device: str,
    blocks: int,
    compute_id: str,
    network_id: str,
    cache: Path,
    out: Path,
    rf: dict[str, list[int]],
) -> list[str]:
    p = "--random_forrest_execution_time_predictor_config_"
    args = [
        "--seed",
        "0",
        "--replica_config_model_name",
        VIDUR_MODEL,
        "--replica_config_device",
        device,
        "--replica_config_network_device",
        NETWORK_DEVICE[device],
        "--replica_config_tensor_parallel_size",
        "1",
        "--replica_config_num_pipeline_stages",
        "1",
        "--cluster_config_num_replicas",
        "1",
        "--global_scheduler_config_type",
        "round_robin",
        "--replica_scheduler_config_type",
        scheduler,
        "--cache_config_block_size",
        str(BLOCK_SIZE),
        "--cache_config_num_blocks",
        str(blocks),
        "--request_generator_config_type",
        "trace_replay",
        "--trace_request_generator_config_trace_file",
        str(trace),
        "--trace_request_generator_config_date",
        TRACE_DATE,
        "--trace_request_generator_config_prefill_scale_factor",
        "1",
        "--trace_request_generator_config_decode_scale_factor",
        "1",
        "--trace_request_generator_config_time_scale_factor",
        "1",
        "--trace_request_generator_config_max_tokens",
        str(MAX_MODEL_LEN),
        "--execution_time_predictor_config_type",
        "random_forrest",
        p + "model_profiling_dataset",
        compute_id,
        p + "network_profiling_dataset",
        network_id,
        p + "cache_dir",
        str(cache),
        p + "prediction_max_tokens_per_request",
        str(MAX_BATCHED_TOKENS),
        p + "prediction_max_batch_size",
        str(MAX_NUM_SEQS),
        p + "prediction_max_prefill_chunk_size",
        str(MAX_BATCHED_TOKENS),
        p + "k_fold_cv_splits",
        str(rf["k_fold"][0]),
        p + "num_estimators",
        *map(str, rf["num_estimators"]),
        p + "max_depth",
        *map(str, rf["max_depth"]),
        p + "min_samples_split",
        *map(str, rf["min_samples_split"]),
        "--metrics_config_output_dir",
        str(out),
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_store_plots",
        "--no-metrics_config_store_batch_metrics",
        "--no-metrics_config_store_utilization_metrics",
    ]
    if scheduler == "vllm":
        args += [
            "--vllm_scheduler_config_batch_size_cap",
            str(MAX_NUM_SEQS),
            "--vllm_scheduler_config_max_tokens_in_batch",
            str(MAX_BATCHED_TOKENS),
        ]
    else:
        args += [
            "--sarathi_scheduler_config_batch_size_cap",
            str(MAX_NUM_SEQS),
            "--sarathi_scheduler_config_chunk_size",
            str(MAX_BATCHED_TOKENS),
        ]
    return args


def run_vidur(
    args: list[str], out: Path, trace: list[dict[str, float]], rate: float, log: Path
) -> dict:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONHASHSEED": "0"}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(
            [str(VIDUR_VENV / "bin/python"), "-m", "vidur.main", *args],
            cwd=out,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"vidur failed (exit {proc.returncode}); log: {log}\n{log.read_text()[-3000:]}"
        )
    (metrics,) = out.glob("*/request_metrics.csv")
    # The first run on a profile trains Vidur's random forests (cached in its cache_dir after).
    text = log.read_text()
    trained = "Trained model" in text
    return vidur_summary(metrics, trace, rate) | {
        "wall_s": wall,
        "wall_s_simulation": _logged_seconds(text, "Starting simulation", "Simulation ended"),
        "trained_predictors": trained,
    }


def _logged_seconds(text: str, start: str, end: str) -> float | None:
    """Seconds between two of Vidur's log lines (`INFO MM-DD HH:MM:SS ...`; 1 s resolution)."""
    stamps = {}
    for line in text.splitlines():
        for key in (start, end):
            if key in line and key not in stamps:
                h, m, sec = line.split()[2].split(":")
                stamps[key] = 3600 * int(h) + 60 * int(m) + int(sec)
    return float(stamps[end] - stamps[start]) if len(stamps) == 2 else None


# Runs Vidur's own entry point with its execution-time predictor wrapped to record every batch
# it prices (num_q_tokens, num_kv_tokens, seconds), for `step_check`.
BATCH_RECORDER = """
import json, sys
from vidur.config import SimulationConfig
from vidur.execution_time_predictor.base_execution_time_predictor import BaseExecutionTimePredictor
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
batches, price = [], BaseExecutionTimePredictor.get_execution_time
def record(self, batch, stage):
    t = price(self, batch, stage)
    batches.append((list(batch.num_q_tokens), list(batch.num_kv_tokens), t.total_time))
    return t
BaseExecutionTimePredictor.get_execution_time = record
path = sys.argv.pop(1)
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
Simulator(config).run()
json.dump(batches, open(path, "w"))
"""


def step_check(args: list[str], out: Path, device: str, log: Path) -> dict[str, Any]:
    """Every batch one Vidur run executed, priced by Vidur and by tandem's roofline-cost
    (`breakdown` on the same query and context lengths): how far apart the two cost models
    are on identical steps, by kind of step."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    path = out / "batches.json"
    with log.open("w") as f:
        subprocess.run(
            [str(VIDUR_VENV / "bin/python"), "-c", BATCH_RECORDER, str(path), *args],
            cwd=out,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
        )
    shape, spec = model_shape(MODEL), device_spec(device)
    kinds: dict[str, list[tuple[float, float, dict[str, float]]]] = {}
    for q, kv, seconds in json.loads(path.read_text()):
        context = tuple(k - n for n, k in zip(q, kv, strict=True))
        # sampled: every decode and every prefill chunk (a chunk short of its prompt does
        # not sample in tandem; the LM head's FLOPs are under 1 % of such a step).
        phases = breakdown(shape, spec, StepShape(tuple(q), context, len(q)))
        decode_only = all(n == 1 for n in q)
        size = len(q)
        kind = (
            "prefill/mixed"
            if not decode_only
            else "decode, batch < 32"
            if size < 32
            else "decode, batch 32-127"
            if size < 128
            else "decode, batch >= 128"
        )
        kinds.setdefault(kind, []).append((1e3 * seconds, phases))
    result: dict[str, Any] = {}
    total_v = total_r = 0.0
    for kind, items in sorted(kinds.items()):
        v = sum(ms for ms, _ in items)
        r = 1e3 * sum(sum(ph.values()) for _, ph in items)
        total_v, total_r = total_v + v, total_r + r
        result[kind] = {
            "batches": len(items),
            "vidur_ms_mean": round(v / len(items), 3),
            "roofline_ms_mean": round(r / len(items), 3),
            "roofline_linear_ms_mean": round(
                1e3 * sum(ph["linear"] for _, ph in items) / len(items), 3
            ),
            "roofline_attention_ms_mean": round(
                1e3 * sum(ph["attention"] for _, ph in items) / len(items), 3
            ),
            "vidur/roofline": round(v / r, 3),
        }
    result["all"] = {
        "vidur_busy_s": round(total_v / 1e3, 2),
        "roofline_busy_s": round(total_r / 1e3, 2),
        "vidur/roofline": round(total_v / total_r, 3),
    }
    return result


def vidur_summary(path: Path, trace: list[dict[str, float]], rate: float) -> dict:
    """TTFT/TPOT/E2E/throughput from Vidur's per-request metrics (module docstring)."""
    ttft, tpot, e2e, ends, tokens, restarts = [], [], [], [], 0, 0
    with path.open() as f:
        for row in csv.DictReader(f):
            rid = int(float(row["Request Id"]))
            d = int(float(row["request_num_decode_tokens"]))
            assert d == trace[rid]["output"], (rid, d, trace[rid]["output"])
            ttft.append(float(row["prefill_e2e_time"]))
            e2e.append(float(row["request_e2e_time"]))
            if d > 1:
                tpot.append(
                    float(row["decode_time_execution_plus_preemption_normalized"]) * d / (d - 1)
                )
            ends.append(trace[rid]["arrival"] / rate + float(row["request_e2e_time"]))
            tokens += d
            restarts += int(float(row.get("request_num_restarts") or 0))
    duration = max(ends)
    t, p, e = stats_ms(ttft), stats_ms(tpot), stats_ms(e2e)
    return {
        "ttft_ms": {"p50": t["p50"], "p90": t["p90"]},
        "tpot_ms": {"p50": p["p50"], "p90": p["p90"]},
        "e2e_ms": {"p50": e["p50"]},
        "request_throughput": len(e2e) / duration,
        "output_throughput": tokens / duration,
        "completed": len(e2e),
        "num_preemptions": restarts,
        "duration_s": duration,
    }


def ratios(a: dict, b: dict) -> dict[str, float]:
    """a / b for each reported metric."""
    pairs = {
        "ttft_p50": ("ttft_ms", "p50"),
        "ttft_p90": ("ttft_ms", "p90"),
        "tpot_p50": ("tpot_ms", "p50"),
        "tpot_p90": ("tpot_ms", "p90"),
        "e2e_p50": ("e2e_ms", "p50"),
    }
    out = {k: round(a[m][q] / b[m][q], 3) for k, (m, q) in pairs.items()}
    out["request_throughput"] = round(a["request_throughput"] / b["request_throughput"], 3)
    out["output_throughput"] = round(a["output_throughput"] / b["output_throughput"], 3)
    return out


# ----------------------------------------------------------------------------- the setups


TANDEM_RUNS = {
    # name: (stack, --engine-time)
    "tandem-sync": ("examples/simulate/fcfs-sync.yaml", None),
    "tandem-sync-nocpu": ("examples/simulate/fcfs-sync.yaml", "modelled:step=0,per_request=0"),
    "tandem-async": ("examples/simulate/fcfs-async.yaml", None),
}
VIDUR_RUNS = {"vidur-vllm": "vllm", "vidur-sarathi": "sarathi"}
RATIO_PAIRS = {
    "tandem-sync/vidur-vllm": ("tandem-sync", "vidur-vllm"),
    "tandem-sync-nocpu/vidur-sarathi": ("tandem-sync-nocpu", "vidur-sarathi"),
}


def linear_profile_vs_roofline(device: str, mlp_csv: Path) -> list[dict[str, float]]:
    """Per layer, the four linear ops (and everything the profile times) against roofline-cost's
    linear phase per layer, at a few token counts."""
    params = sum(linear_op_params().values())
    rows = {}
    with mlp_csv.open() as f:
        for row in csv.DictReader(f):
            if row["num_tensor_parallel_workers"] == "1" and int(row["num_tokens"]) not in rows:
                rows[int(row["num_tokens"])] = row
    out = []
    for t in (1, 64, 256, 512, 1024, 2048, 4096, 8192):
        if t not in rows:
            continue
        r = rows[t]
        linear = sum(
            float(r.get(f"time_stats.{op}.median") or 0.0)
            for op in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
        )
        other = sum(
            float(r.get(f"time_stats.{op}.median") or 0.0)
            for op in ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
        )
        roof = roofline_linear_ms(device, params, t)
        out.append(
            {
                "num_tokens": t,
                "profile_linear_ms": round(linear, 4),
                "profile_elementwise_ms": round(other, 4),
                "roofline_linear_ms": round(roof, 4),
                "roofline/profile_linear": round(roof / linear, 3),
            }
        )
    return out


def run_setup(
    name: str,
    device: str,
    rates: list[float],
    trace: list[dict[str, float]],
    work: Path,
    vidur_data: Path | None,
    mlp_profile: Path | None,
    rf: dict[str, list[int]],
) -> dict[str, Any]:
    blocks = tandem_kv_blocks(device)
    cache = VIDUR_VENV / "cache" / name
    cache.mkdir(parents=True, exist_ok=True)
    compute_id, network_id, source = prepare_profiles(
        device, cache, blocks * BLOCK_SIZE, vidur_data, mlp_profile
    )
    print(f"[{name}] {device}, {blocks} KV blocks; Vidur profile: {source}", flush=True)
    result: dict[str, Any] = {
        "device": device,
        "kv_blocks": blocks,
        "vidur_profile": source,
        "rates": {},
    }
    if mlp_profile is not None:
        result["linear_profile_vs_roofline"] = linear_profile_vs_roofline(device, mlp_profile)
    for rate in rates:
        tandem_trace, vidur_trace = write_traces(trace, rate, work / name)
        runs: dict[str, Any] = {}
        for run, scheduler in VIDUR_RUNS.items():
            out = work / name / f"vidur-{scheduler}-{rate:g}"
            args = vidur_args(
                scheduler, vidur_trace, device, blocks, compute_id, network_id, cache, out, rf
            )
            runs[run] = run_vidur(args, out, trace, rate, work / name / f"{run}-{rate:g}.log")
            runs[run]["command"] = "python -m vidur.main " + " ".join(args).replace(
                str(ROOT) + "/", ""
            )
            print(f"  rate {rate:g} {run}: {_line(runs[run])}", flush=True)
        for run, (stack, engine_time) in TANDEM_RUNS.items():
            out = work / name / f"{run}-{rate:g}.json"
            runs[run] = run_tandem(stack, tandem_trace, device, out, engine_time)
            print(f"  rate {rate:g} {run}: {_line(runs[run])}", flush=True)
        result["rates"][f"{rate:g}"] = {
            "simulators": runs,
            "ratios": {k: ratios(runs[a], runs[b]) for k, (a, b) in RATIO_PAIRS.items()},
        }
    # The same steps priced by both cost models, on Vidur's sarathi batches at the top rate.
    rate = rates[-1]
    args = vidur_args(
        "sarathi",
        work / name / f"trace-{rate:g}.csv",
        device,
        blocks,
        compute_id,
        network_id,
        cache,
        work / name / "step-check",
        rf,
    )
    result["step_check"] = {"rate": rate, "scheduler": "sarathi"} | step_check(
        args, work / name / "step-check", device, work / name / "step-check.log"
    )
    print(f"  step check at rate {rate:g}: {result['step_check']['all']}", flush=True)
    return result


def _line(r: dict) -> str:
    return (
        f"ttft {r['ttft_ms']['p50']:.1f}/{r['ttft_ms']['p90']:.1f} ms, tpot "
        f"{r['tpot_ms']['p50']:.2f}/{r['tpot_ms']['p90']:.2f} ms, e2e50 {r['e2e_ms']['p50']:.0f} ms, "
        f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} tok/s, "
        f"preempt {r['num_preemptions']}, wall {r['wall_s']:.1f} s"
    )


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", type=_rates, default=[6.0, 12.0, 20.0], help="H100 rates, req/s")
    p.add_argument(
        "--vidur-data",
        type=Path,
        default=os.environ.get("VIDUR_DATA") or None,
        help="Vidur's own Llama-3-8B/H100 profiles (default $VIDUR_DATA)",
    )
    p.add_argument(
        "--a100-mlp-profile",
        type=Path,
        help="Vidur's measured a100 Meta-Llama-3-8B mlp.csv: adds an A100 setup",
    )
    p.add_argument("--a100-rates", type=_rates, default=[2.0, 4.0, 7.0])
    p.add_argument("--rf-estimators", type=int, nargs="+", default=[250])
    p.add_argument("--rf-max-depth", type=int, nargs="+", default=[16, 32])
    p.add_argument("--rf-min-samples-split", type=int, nargs="+", default=[2])
    p.add_argument("--rf-k-fold", type=int, default=5)
    p.add_argument("--work", type=Path, default=VIDUR_VENV / "work")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args()
    if not (VIDUR_VENV / "bin/python").exists():
        raise SystemExit("no Vidur venv: run benchmarks/peers/setup_vidur.sh first")
    rf = {
        "num_estimators": a.rf_estimators,
        "max_depth": a.rf_max_depth,
        "min_samples_split": a.rf_min_samples_split,
        "k_fold": [a.rf_k_fold],
    }
    trace = make_trace(a.requests, a.seed)
    version = subprocess.run(
        [
            str(VIDUR_VENV / "bin/python"),
            "-c",
            "from vidur._version import __version__ as v; print(v)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    started = time.perf_counter()
    setups = {
        "h100": run_setup("h100", "h100", a.rates, trace, a.work, a.vidur_data, None, rf),
    }
    if a.a100_mlp_profile:
        setups["a100-measured-linear"] = run_setup(
            "a100-measured-linear",
            "a100",
            a.a100_rates,
            trace,
            a.work,
            None,
            a.a100_mlp_profile,
            rf,
        )
    prompts = [r["prompt"] for r in trace]
    outputs = [r["output"] for r in trace]
    result = {
        "vidur_version": version,
        "model": {"tandem": MODEL, "vidur": VIDUR_MODEL},
        "trace": {
            "requests": a.requests,
            "seed": a.seed,
            "arrivals": "Poisson",
            "prompt": "lognormal(mean 1024, sigma 0.8) in [16, 3072]",
            "output": "lognormal(mean 256, sigma 0.7) in [2, 1024]",
            "prompt_mean": float(np.mean(prompts)),
            "output_mean": float(np.mean(outputs)),
        },
        "limits": {
            "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "tp": 1,
        },
        "vidur_random_forest_grid": rf,
        "metric_definitions": {
            "vidur_ttft": "prefill_e2e_time",
            "vidur_tpot": "decode_time_execution_plus_preemption_normalized * D / (D - 1)",
            "vidur_e2e": "request_e2e_time",
            "throughput": "completed requests (output tokens) / last finish time, first arrival at 0",
        },
        "setups": setups,
        "total_wall_s": time.perf_counter() - started,
        "machine": f"{os.cpu_count()} CPUs (shared)",
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out.relative_to(ROOT) if a.out.is_relative_to(ROOT) else a.out}")


if __name__ == "__main__":
    sys.exit(main())
