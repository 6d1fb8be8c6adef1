"""`tandem trace`: record sync and async runs on the simulated device and draw them.

Writes `<out>.json` (Chrome trace events: process 0 = sync, process 1 = async, lanes
"engine" and "device"), `<out>.png` (the two timelines one above the other, like the two
diagrams of the async-scheduling document) and `<out>.stats.json` (device-busy fraction of
wall time and the engine's CPU time per step, for each loop). `<out>` defaults to
`tandem-trace` in the current directory; the paths written are printed. Drawing needs
matplotlib (`pip install 'tandem[trace]'`); `--no-png` writes the JSON files only.

`--diffusion` runs the scripted block-diffusion model (`scripted-diffusion`, the diffusion
scheduler) instead: the trace gains the lanes "denoise" (one span per step that denoised
canvases, with how many) and "commit" (one per committed canvas: request id and token
count), the PNG a third row with the denoising steps and the commits as ticks, and the
stats the engine's diffusion figures (`engine.stats()["diffusion"]`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.plugins.tracing import StepTracer

MATPLOTLIB_HINT = (
    "tandem trace: drawing the timeline needs matplotlib: pip install 'tandem[trace]' "
    "(or pip install matplotlib); --no-png writes the JSON files only"
)


def record(
    async_scheduling: bool,
    requests: int,
    prompt: int,
    output: int,
    max_num_batched_tokens: int = 2048,
    diffusion: bool = False,
) -> tuple[StepTracer, dict[str, Any]]:
    """Run `requests` scripted requests on the simulated device with tracing on (the
    `hook-tracing` plugin); return the tracer (engine, hooks and device spans; with
    `diffusion`, on `scripted-diffusion`, also denoise and commit spans) and the run's
    figures."""
    from tandem.core.request import Request
    from tandem.plugins.tracing import Span, StepTracer, enable_tracing
    from tandem.schema.sampling_params import SamplingParams
    from tandem.testing import make_scripted_engine

    max_len = prompt + output + 16
    engine = make_scripted_engine(
        model="scripted-diffusion" if diffusion else "scripted",
        parallel={"executor": "simulated"},
        async_scheduling=async_scheduling,
        check_invariants=False,
        trace_hooks=True,
        max_model_len=max_len,
        max_num_seqs=requests,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=16,
        num_kv_blocks=requests * (-(-max_len // 16)),
    )
    tracer = StepTracer()
    tracing = enable_tracing(engine, tracer)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i in range(requests):
        engine.add_request(
            Request(str(i), [rng.randrange(2, 128) for _ in range(prompt)], params, eos_token_id=1)
        )
    cpu = 0.0
    calls = 0
    start = time.perf_counter()
    while engine.has_work():
        t0 = time.thread_time()
        engine.step_fn()
        cpu += time.thread_time() - t0
        calls += 1
    end = time.perf_counter()
    executor = engine.executor
    device_steps = [s for s in executor.spans if s.kind == "execute"]
    for s in device_steps:
        tracer.add(Span("device", f"step {s.step_id}", s.start, s.end, s.step_id))
    stats = {
        "async_scheduling": async_scheduling,
        "wall_s": end - start,
        "device_busy_fraction": executor.busy_fraction(start, end),
        "engine_cpu_ms_per_step": 1000 * cpu / max(engine.num_steps, 1),
        "modelled_device_ms_per_step": 1000
        * sum(s.end - s.start for s in device_steps)
        / max(len(device_steps), 1),
        "steps": engine.num_steps,
        "engine_calls": calls,
        "hook_times": tracing.summary(engine.num_steps),
    }
    if diffusion:
        stats["diffusion"] = engine.stats()["diffusion"]
    engine.shutdown()
    return tracer, stats


def _draw_diffusion_row(ax: Any, tracer: StepTracer, t0: float) -> None:
    """Row 3 (diffusion runs only): denoising steps as bars (alternating colours, one per
    step), commits as black ticks."""
    steps = [s for s in tracer.spans if s.lane == "denoise"]
    for i, s in enumerate(steps):
        colour = ("tab:cyan", "teal")[i % 2]
        ax.broken_barh([((s.start - t0) * 1000, (s.end - s.start) * 1000)], (20, 8), color=colour)
    commits = [(s.start - t0) * 1000 for s in tracer.spans if s.lane == "commit"]
    if commits:
        ax.vlines(commits, 20, 28, colors="black", linewidth=0.8)


def draw(tracers: list[tuple[str, StepTracer]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"schedule": "tab:blue", "update": "tab:green", "wait": "lightgrey"}
    fig, axes = plt.subplots(len(tracers), 1, figsize=(12, 2.2 * len(tracers)), sharex=True)
    for ax, (title, tracer) in zip(axes, tracers, strict=True):
        t0 = min(s.start for s in tracer.spans)
        _draw_diffusion_row(ax, tracer, t0)
        for row, lane in enumerate(("device", "engine")):
            spans = [s for s in tracer.spans if s.lane == lane]
            for s in spans:
                colour = "tab:orange" if lane == "device" else colours.get(s.name, "tab:purple")
                ax.broken_barh(
                    [((s.start - t0) * 1000, (s.end - s.start) * 1000)], (row * 10, 8), color=colour
                )
        ticks = [4, 14] + ([24] if any(s.lane == "denoise" for s in tracer.spans) else [])
        ax.set_yticks(ticks, labels=["device", "engine CPU", "denoise / commits"][: len(ticks)])
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel("ms")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c)
        for c in ("tab:orange", "tab:blue", "tab:green", "lightgrey")
    ]
    fig.legend(
        handles,
        ["device step", "schedule", "update", "engine waits"],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem trace", description=__doc__)
    parser.add_argument(
        "--out",
        default="tandem-trace",
        help="output path without extension (default: tandem-trace in the current directory)",
    )
    parser.add_argument("--no-png", action="store_true", help="skip the PNG (no matplotlib)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--output", type=int, default=40)
    parser.add_argument(
        "--diffusion",
        action="store_true",
        help="run the scripted block-diffusion model: denoise and commit lanes",
    )
    parser.add_argument(
        "--window-ms", type=float, default=0.0, help="draw only the first N ms (0 = all)"
    )
    args = parser.parse_args(argv)
    if not args.no_png:
        try:
            import matplotlib  # noqa: F401 - checked before the runs, not after
        except ImportError:
            print(MATPLOTLIB_HINT, file=sys.stderr)
            return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = [
        record(mode, args.requests, args.prompt, args.output, diffusion=args.diffusion)
        for mode in (False, True)
    ]
    events: list[dict] = []
    for pid, ((tracer, _stats), name) in enumerate(
        zip(runs, ("sync step()", "async step_with_batch_queue()"), strict=True)
    ):
        events += tracer.to_chrome_trace(name, pid=pid)
    out.with_suffix(".json").write_text(json.dumps({"traceEvents": events}))
    if args.window_ms > 0:
        for tracer, _ in runs:
            t0 = min(s.start for s in tracer.spans)
            tracer.spans = [s for s in tracer.spans if (s.start - t0) * 1000 <= args.window_ms]
    titles = [
        f"{'async' if st['async_scheduling'] else 'sync'}: device busy {st['device_busy_fraction']:.1%} of wall, "
        f"engine CPU {st['engine_cpu_ms_per_step']:.2f} ms/step"
        for _, st in runs
    ]
    written = [out.with_suffix(".json"), out.with_suffix(".stats.json")]
    if not args.no_png:
        draw([(t, tr) for t, (tr, _) in zip(titles, runs, strict=True)], out.with_suffix(".png"))
        written.append(out.with_suffix(".png"))
    stats = {"sync": runs[0][1], "async": runs[1][1], "workload": vars(args)}
    out.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))
    print(f"tandem trace: wrote {', '.join(str(p.resolve()) for p in written)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
