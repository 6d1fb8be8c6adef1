"""The `kv-offload` connector on a chat workload whose shared prefixes are several times
larger than the device KV pool: prefix hit rate and TTFT p50/p90 with and without it, and
after an engine restart on the same directory, side by side in one run.

    python benchmarks/kv_offload.py [--repeats 3] [--threads 1] [--out PATH] [--smoke]

Workload (seeded, new documents each repeat): `--docs` system prompts ("manuals" of
generated English sentences, about `--prefix-tokens` tokens each through the model's chat
template) and `--rounds` rounds of chat turns; each turn is one system prompt plus a short
user question (unique per turn) through the chat template, greedy, `--max-tokens` output
tokens. Each round visits every document once, in a seeded order, with at least `--min-gap`
other turns between two uses of one document: the device pool (`num_kv_blocks`, sized to
hold the longest turn and no more) is several times smaller than the documents together
(the ratio is in the JSON), so without a connector every turn recomputes its prefix.
Turns are sequential chat turns (one request at a time, `LLM.generate`), so TTFT
(`metrics.first_token_time - metrics.arrival_time`) is that turn's admission, KV load (from
the connector's tier) and prefill of what was not found, and its first token.

Configurations, all on the embedded SmolLM2-135M with the default plugin stack, the same
pool and prefix caching on; the connector through vLLM's `kv_transfer_config`:
- `no-connector`: the pool's own prefix cache only;
- `offload`: `kv-offload` with a host tier large enough for every block of the run and a
  disk tier in a temporary directory (which it never has to use: nothing leaves the host
  tier); hits come from host memory;
- `offload-disk`: `kv-offload` with `cpu_blocks: 0` (every block saved goes to a file):
  hits come from files this engine wrote. Needed because `kv-offload` writes a file only
  when a block leaves the host tier and does not flush at shutdown, so the `offload`
  engine leaves no files for a restarted engine;
- `offload-restart`: a new engine started on the directory `offload-disk` filled, after
  that engine was shut down, with `cpu_blocks` small: its hits come from files written by
  the previous engine. It replays the same turns (the outputs must be identical), so it
  also finds the questions' full blocks on disk, not only the shared prefixes.
`no-connector` and `offload` each keep one engine for the whole run (every repeat has new
documents); `offload-disk` and `offload-restart` get a new engine and directory per
repeat. Every engine answers one unrelated warm-up request first. Configurations are
interleaved within each repeat (rotated order; `offload-restart` right after
`offload-disk`). The files are read back while they are likely still in the OS page cache.

Prefix hit rate: prompt tokens not computed / prompt tokens, over the measured turns, from
`llm.engine.stats()` deltas: (`prefix_cache_hits` + `kv_connector_external_hit_tokens`) /
`prefix_cache_queries`; `shared_prefix_hit_rate` counts only the tokens found within the
whole blocks of each turn's system prompt (from per-turn deltas). Per configuration: TTFT p50 and p90 over the turns of a repeat,
then medians over repeats; ratios to `no-connector`. Token ids of every turn must be the
same in every configuration (asserted; `outputs_identical` in the JSON).

Time: about 5.5 minutes with the defaults on 2 AVX2 cores, 1 thread (longer under load);
`--smoke` (1 repeat, 4 documents of ~128 tokens, 2 rounds) about 1 minute.
Writes <out> (default benchmarks/results/kv_offload.json) and <out>.png (TTFT p50/p90 bars
and the hit rate per configuration), with the CPU flags and torch threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent
CONFIGS = ("no-connector", "offload", "offload-disk", "offload-restart")
BLOCK_SIZE = 16
RESTART_CPU_BLOCKS = 8
CONFIG_NOTES = {
    "no-connector": "default stack: the pool's own prefix cache only",
    "offload": "host tier holds every block of the run (hits from host memory); one engine",
    "offload-disk": "cpu_blocks 0: every saved block is a file; new engine and directory "
    "per repeat",
    "offload-restart": "new engine on the directory offload-disk filled, after that engine "
    "was shut down; replays the same turns",
}

# Word lists of the generated documents and questions ----------------------------------
PRODUCTS = ["Aurora", "Basalt", "Cinder", "Delta", "Ember", "Fjord", "Granite", "Harbor"]
PRODUCTS += ["Iris", "Juniper", "Kestrel", "Lumen", "Meridian", "Nimbus", "Orchid", "Pylon"]
SUBJECTS = ["The operator", "Each technician", "A new user", "The service team", "The owner"]
SUBJECTS += ["The installer", "Every administrator", "The night shift", "A trained assistant"]
VERBS = ["should inspect", "must calibrate", "can replace", "needs to clean", "may reset"]
VERBS += ["has to register", "should lubricate", "must never open", "can upgrade", "records"]
NOUNS = ["the intake valve", "the control panel", "the filter cartridge", "the main fuse"]
NOUNS += ["the pressure sensor", "the backup battery", "the cooling fan", "the drive belt"]
NOUNS += ["the firmware image", "the warranty card", "the water tank", "the display unit"]
WHEN = ["before the first start", "once a month", "after every long shutdown", "at night"]
WHEN += ["when the warning light blinks", "during the yearly service", "if the noise grows"]
WHEN += ["before moving the device", "after a power cut", "when the readings drift"]
WHY = ["to keep the warranty valid", "so that the output stays stable", "to avoid leaks"]
WHY += ["because dust lowers the efficiency", "to protect the electronics", "for safety"]
QUESTIONS = ["How often do I clean {n}?", "What happens if I skip servicing {n}?"]
QUESTIONS += ["Who is allowed to replace {n}?", "Where do I find {n}?", "Can I reset {n}?"]
QUESTIONS += ["Is it safe to touch {n} while running?", "What tools does {n} need?"]
QUESTIONS += ["Why does {n} make noise?", "When should {n} be checked?"]


def cpu_flags() -> dict[str, Any]:
    """The CPU model and the SIMD flags that decide kernel speed (from /proc/cpuinfo)."""
    model, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"model": model, "cores": len(os.sched_getaffinity(0))} | {f: f in flags for f in wanted}


# Workload -------------------------------------------------------------------------------
def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _document(rng: random.Random, tokenizer: Any, target_tokens: int) -> str:
    """A system prompt: a product manual of generated sentences, grown sentence by sentence
    until its chat-template turn has at least `target_tokens` tokens."""
    product = f"{rng.choice(PRODUCTS)} {rng.randint(100, 999)}"
    text = f"You are the support assistant for the {product}. Answer from this manual.\n"
    while len(_chat_ids(tokenizer, [{"role": "system", "content": text}], False)) < target_tokens:
        words = (rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(NOUNS), rng.choice(WHEN))
        text += " ".join(words) + f" {rng.choice(WHY)}."
        text += "\n" if rng.random() < 0.2 else " "
    return text


def _order(rng: random.Random, docs: int, rounds: int, min_gap: int) -> list[int]:
    """Document of each turn: every round a seeded permutation, with at least `min_gap`
    other turns between two uses of a document."""
    seq: list[int] = []
    for _ in range(rounds):
        while True:
            perm = rng.sample(range(docs), docs)
            last = {d: i for i, d in enumerate(seq)}
            if all(len(seq) + j - last.get(d, -docs) - 1 >= min_gap for j, d in enumerate(perm)):
                break
        seq += perm
    return seq


def build_workload(tokenizer: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Turns as token ids, each with its document index and shared-prefix length."""
    rng = random.Random(seed)
    docs = [_document(rng, tokenizer, args.prefix_tokens) for _ in range(args.docs)]
    prefix_ids = [_chat_ids(tokenizer, [{"role": "system", "content": d}], False) for d in docs]
    asked: dict[int, set[str]] = {d: set() for d in range(args.docs)}
    turns: list[dict[str, Any]] = []
    for d in _order(rng, args.docs, args.rounds, args.min_gap):
        while True:
            question = rng.choice(QUESTIONS).format(n=rng.choice(NOUNS))
            if question not in asked[d]:
                asked[d].add(question)
                break
        messages = [{"role": "system", "content": docs[d]}, {"role": "user", "content": question}]
        ids = _chat_ids(tokenizer, messages, True)
        assert ids[: len(prefix_ids[d])] == prefix_ids[d], "the system turn is a token prefix"
        turns.append({"doc": d, "ids": ids, "prefix": len(prefix_ids[d])})
    return {"turns": turns, "prefix_tokens": [len(p) for p in prefix_ids]}


# Engines --------------------------------------------------------------------------------
def _connector(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's `kv_transfer_config` selecting `kv-offload` with `options` (None: none)."""
    if options is None:
        return None
    return {
        "kv_connector": "kv-offload",
        "kv_role": "kv_both",
        "kv_connector_extra_config": options,
    }


_WARM_UPS = itertools.count()


def make_engine(pool_blocks: int, threads: int, connector: dict[str, Any] | None) -> LLM:
    """An engine on the default model with a `pool_blocks` pool, warmed up by one request of
    tokens no other engine of the run sees (so never a store hit)."""
    kwargs: dict[str, Any] = {
        "num_kv_blocks": pool_blocks,
        "block_size": BLOCK_SIZE,
        "max_model_len": pool_blocks * BLOCK_SIZE,
        "worker_num_threads": threads,
    }
    if connector is not None:
        kwargs["kv_transfer_config"] = _connector(connector)
    llm = LLM(**kwargs)
    warm_rng = random.Random(f"warm-up {next(_WARM_UPS)}")
    warm = [warm_rng.randrange(100, 40_000) for _ in range(48)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    return llm


HIT_KEYS = ("prefix_cache_hits", "kv_connector_external_hit_tokens")


def _counters(stats: dict[str, Any]) -> dict[str, float]:
    out = {
        k: float(stats.get(k, 0))
        for k in (
            "prefix_cache_queries",
            "prefix_cache_hits",
            "kv_connector_external_hit_tokens",
            "kv_connector_failed_load_blocks",
            "num_preemptions",
        )
    }
    for k, v in (stats.get("kv_connector_transfers") or {}).items():
        out[f"transfers.{k}"] = float(v)
    return out


def run_turns(llm: LLM, turns: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """The turns one at a time: TTFT of each, its output ids, the tokens it found (local
    prefix cache plus connector) and the counters' deltas over all of them."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = before = _counters(llm.engine.stats())
    ttft: list[float] = []
    hits: list[int] = []
    outputs: list[list[int]] = []
    for turn in turns:
        out = llm.generate([{"prompt_token_ids": turn["ids"]}], params, use_tqdm=False)[0]
        m = out.metrics
        assert m.first_token_time is not None
        ttft.append(m.first_token_time - m.arrival_time)
        outputs.append(list(out.outputs[0].token_ids))
        after = _counters(llm.engine.stats())
        hits.append(round(sum(after[k] - before[k] for k in HIT_KEYS)))
        before = after
    delta = {k: before.get(k, 0.0) - first.get(k, 0.0) for k in before}
    return {
        "ttft_s": ttft,
        "hit_tokens": hits,
        "outputs": outputs,
        "counters": delta,
        "hit_rate": sum(hits) / delta["prefix_cache_queries"],
    }


# Summaries ------------------------------------------------------------------------------
def _p(values: list[float], q: int) -> float:
    """The q-th percentile (linear interpolation between closest ranks)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(run: dict[str, Any], turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One repeat of one configuration: TTFT percentiles (all turns, and the turns whose
    document was used before in the repeat), hit rates, load cost per block and tier."""
    seen: set[int] = set()
    reuse: list[float] = []
    prefix_hit = prefix_all = 0
    for turn, t, hit in zip(turns, run["ttft_s"], run["hit_tokens"], strict=True):
        if turn["doc"] in seen:
            reuse.append(t)
        seen.add(turn["doc"])
        shareable = turn["prefix"] // BLOCK_SIZE * BLOCK_SIZE  # its whole blocks
        prefix_hit += min(hit, shareable)
        prefix_all += shareable
    ms = [1000 * t for t in run["ttft_s"]]
    c = run["counters"]
    load_ms_per_block = {
        tier: 1000 * c[f"transfers.load_seconds@{tier}"] / (c[key] / BLOCK_SIZE)
        for tier in ("cpu", "disk")
        if c.get(key := f"transfers.loaded_tokens@{tier}")
    }
    return {
        "ttft_p50_ms": _p(ms, 50),
        "ttft_p90_ms": _p(ms, 90),
        "ttft_p50_reuse_turns_ms": _p([1000 * t for t in reuse], 50) if reuse else None,
        "hit_rate": run["hit_rate"],
        "shared_prefix_hit_rate": prefix_hit / prefix_all,
        "load_ms_per_block": load_ms_per_block,
        "counters": c,
        "ttft_ms": [round(x, 3) for x in ms],
        "hit_tokens": run["hit_tokens"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["results"])
    med = [result["results"][n] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    x = range(len(names))
    w = 0.38
    p50 = [r["ttft_p50_ms"] for r in med]
    p90 = [r["ttft_p90_ms"] for r in med]
    b1 = ax1.bar([i - w / 2 for i in x], p50, w, label="TTFT p50")
    b2 = ax1.bar([i + w / 2 for i in x], p90, w, label="TTFT p90")
    ax1.bar_label(b1, fmt="%.0f", fontsize=8)
    ax1.bar_label(b2, fmt="%.0f", fontsize=8)
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("ms (median over repeats)")
    ax1.set_title("Time to first token, sequential chat turns")
    ax1.legend()
    hits = [100 * r["hit_rate"] for r in med]
    b3 = ax2.bar(list(x), hits, 0.6, color="tab:green")
    ax2.bar_label(b3, fmt="%.1f%%", fontsize=8)
    ax2.set_xticks(list(x), names, rotation=20)
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("% of prompt tokens not computed")
    ax2.set_title("Prefix hit rate")
    shape = result["workload"]
    fig.suptitle(
        f"kv-offload: {shape['docs']} shared prefixes = {result['pool']['prefix_over_pool']:.1f}x"
        f" the device pool, {shape['turns_per_repeat']} turns, {result['torch_threads']} thread(s)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Main -----------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", help="default: benchmarks/results/kv_offload.json (--smoke: in the temp dir)"
    )
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-gap", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="1 repeat, 4 short documents")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.docs, args.prefix_tokens, args.rounds, args.min_gap = 1, 4, 128, 2, 2
    if args.out is None:
        smoke = Path(tempfile.gettempdir()) / "kv_offload_smoke.json"
        args.out = str(smoke if args.smoke else ROOT / "results" / "kv_offload.json")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()

    from tandem.models.model_files import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(Path(resolve_model_dir("default")))
    workloads = [build_workload(tokenizer, args, args.seed + r) for r in range(args.repeats)]
    longest = max(len(t["ids"]) for w in workloads for t in w["turns"]) + args.max_tokens
    pool_blocks = math.ceil(longest / BLOCK_SIZE)  # one turn fits, not two
    turn_blocks = max(len(t["ids"]) // BLOCK_SIZE + 1 for w in workloads for t in w["turns"])
    host_blocks = args.repeats * len(workloads[0]["turns"]) * (turn_blocks + 1) + 64
    tmp = Path(tempfile.mkdtemp(prefix="tandem-kv-offload-"))

    engine_seconds: dict[str, list[float]] = {c: [] for c in CONFIGS}

    def timed_engine(config: str, connector: dict[str, Any] | None) -> LLM:
        t0 = time.perf_counter()
        llm = make_engine(pool_blocks, args.threads, connector)
        engine_seconds[config].append(time.perf_counter() - t0)
        return llm

    def options(config: str, r: int | None = None, real: bool = True) -> dict[str, Any] | None:
        """The connector options of `config` in repeat `r` (`real` False: placeholder paths,
        for the JSON)."""
        root = str(tmp) if real else "<tmp>"
        disk = f"{root}/disk-r{r if real else '<repeat>'}"
        return {
            "no-connector": None,
            "offload": {"cpu_blocks": host_blocks, "disk_path": f"{root}/offload"},
            "offload-disk": {"cpu_blocks": 0, "disk_path": disk},
            "offload-restart": {"cpu_blocks": RESTART_CPU_BLOCKS, "disk_path": disk},
        }[config]

    keep = {c: timed_engine(c, options(c)) for c in ("no-connector", "offload")}
    cfg = keep["no-connector"].config
    settings = {
        "async_scheduling": cfg.scheduler.async_scheduling,
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
        "dtype": cfg.model.dtype,
        "model_dir": cfg.model.model,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
    }
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    disk_files: list[dict[str, Any]] = []
    orders: list[list[str]] = []
    try:
        for r, workload in enumerate(workloads):
            turns = workload["turns"]

            def disk_pair(r: int = r, turns: list[dict[str, Any]] = turns) -> None:
                llm = timed_engine("offload-disk", options("offload-disk", r))
                runs["offload-disk"].append(run_turns(llm, turns, args.max_tokens))
                llm.engine.shutdown()
                files = list((tmp / f"disk-r{r}").rglob("*.kv"))
                size = sum(f.stat().st_size for f in files)
                disk_files.append({"repeat": r, "files": len(files), "bytes": size})
                llm = timed_engine("offload-restart", options("offload-restart", r))
                runs["offload-restart"].append(run_turns(llm, turns, args.max_tokens))
                llm.engine.shutdown()

            def kept(name: str, turns: list[dict[str, Any]] = turns) -> Callable[[], None]:
                return lambda: runs[name].append(run_turns(keep[name], turns, args.max_tokens))

            units: list[tuple[str, Callable[[], None]]] = [
                ("no-connector", kept("no-connector")),
                ("offload", kept("offload")),
                ("offload-disk+offload-restart", disk_pair),
            ]
            units = units[r % len(units) :] + units[: r % len(units)]
            orders.append([name for name, _ in units])
            for name, unit in units:
                print(f"repeat {r}: {name}", flush=True)
                unit()
    finally:
        for llm in keep.values():
            llm.engine.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    mismatches = []
    for r in range(args.repeats):
        expected = runs["no-connector"][r]["outputs"]
        for config in CONFIGS[1:]:
            for i, (a, b) in enumerate(zip(expected, runs[config][r]["outputs"], strict=True)):
                if a != b:
                    mismatches.append({"repeat": r, "config": config, "turn": i, "a": a, "b": b})
    per_repeat = {
        c: [summarize(run, w["turns"]) for run, w in zip(runs[c], workloads, strict=True)]
        for c in CONFIGS
    }
    keys = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p50_reuse_turns_ms", "hit_rate")
    keys += ("shared_prefix_hit_rate",)
    medians = {
        c: {k: statistics.median(s[k] for s in per_repeat[c]) for k in keys} for c in CONFIGS
    }
    base = medians["no-connector"]
    ratios = {
        c: {
            "ttft_p50": medians[c]["ttft_p50_ms"] / base["ttft_p50_ms"],
            "ttft_p90": medians[c]["ttft_p90_ms"] / base["ttft_p90_ms"],
            "ttft_p50_reuse_turns": medians[c]["ttft_p50_reuse_turns_ms"]
            / base["ttft_p50_reuse_turns_ms"],
        }
        for c in CONFIGS[1:]
    }
    prefix_total = [sum(w["prefix_tokens"]) for w in workloads]
    prompt_lens = [len(t["ids"]) for w in workloads for t in w["turns"]]
    result: dict[str, Any] = {
        "what": (
            "TTFT p50/p90 (ms) and prefix hit rate of sequential chat turns over shared "
            "prefixes several times larger than the device KV pool, without and with the "
            "kv-offload connector (host tier, disk tier, restarted engine on the disk tier); "
            "medians over repeats of per-repeat percentiles; ratios config / no-connector"
        ),
        "command": " ".join(["python", "benchmarks/kv_offload.py", *sys.argv[1:]]),
        "model": "embedded SmolLM2-135M-Instruct (default)",
        "measurement": (
            "one request at a time (LLM.generate): TTFT = metrics.first_token_time - "
            "metrics.arrival_time = admission + connector load + prefill of the rest + first "
            "token; hit rate = (prefix_cache_hits + kv_connector_external_hit_tokens) / "
            "prefix_cache_queries over the measured turns (engine.stats() deltas); "
            "shared_prefix_hit_rate = tokens found within the whole blocks of each turn's "
            "shared prefix (the system turn) / those blocks' tokens (at most (rounds - 1) / "
            "rounds for an engine that starts empty)"
        ),
        "workload": {
            "docs": args.docs,
            "rounds": args.rounds,
            "turns_per_repeat": len(workloads[0]["turns"]),
            "min_gap_turns": args.min_gap,
            "target_prefix_tokens": args.prefix_tokens,
            "prefix_tokens_per_doc": [w["prefix_tokens"] for w in workloads],
            "prompt_tokens_min_max": [min(prompt_lens), max(prompt_lens)],
            "max_tokens": args.max_tokens,
            "sampling": "greedy, ignore_eos",
            "seeds": [args.seed + r for r in range(args.repeats)],
            "order_of_docs": [[t["doc"] for t in w["turns"]] for w in workloads],
        },
        "pool": {
            "num_kv_blocks": pool_blocks,
            "block_size": BLOCK_SIZE,
            "pool_tokens": pool_blocks * BLOCK_SIZE,
            "shared_prefix_tokens_per_repeat": prefix_total,
            "prefix_over_pool": statistics.median(prefix_total) / (pool_blocks * BLOCK_SIZE),
        },
        "configs": {
            c: {"kv_transfer_config": _connector(options(c, real=False)), "note": CONFIG_NOTES[c]}
            for c in CONFIGS
        },
        "engine_settings": settings,
        "order_per_repeat": orders,
        "results": medians,
        "ratios_over_no_connector": ratios,
        "outputs_identical": not mismatches,
        "per_repeat": per_repeat,
        "disk_files": disk_files,
        "engine_start_s": engine_seconds,
        "cpu": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "worker_num_threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "wall_s": time.perf_counter() - started,
    }
    if mismatches:
        result["mismatches"] = mismatches[:10]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    for c in CONFIGS:
        m = medians[c]
        print(
            f"{c:16s} TTFT p50 {m['ttft_p50_ms']:8.1f} ms  p90 {m['ttft_p90_ms']:8.1f} ms  "
            f"hit rate {100 * m['hit_rate']:5.1f}%"
        )
    print("ratios over no-connector:", json.dumps(ratios))
    print("wrote", out, "and", out.with_suffix(".png"))
    assert not mismatches, f"outputs differ: {mismatches[:3]}"


if __name__ == "__main__":
    main()
