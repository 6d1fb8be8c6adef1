"""`tandem simulate`: stacks side by side on a simulated device, on a virtual clock.

    tandem simulate --stack fcfs.yaml --stack srpt.yaml \\
        --traffic "gamma:rate=20,cv=3,duration=3600,prompt=lognormal(1024,0.8),output=256" \\
        --model llama-3-8b --device h200 --slo-ttft-ms 2000 --slo-tpot-ms 100 \\
        [--rates 10,20,30,40] --out sim.json --plot sim.png

Each stack file is an ordinary stack YAML (scheduler, cache, speculative, plugins); its
model is replaced by the token oracle (`VirtualDeviceExecutor`) and its step times come
from the cost model: the stack's own `step_cost` plugin if it names one, else the
`roofline-cost` plugin for `--model`/`--device`. A stack with a `diffusion` section, or a
diffusion model shape (`--model diffusion-gemma`), runs the scripted diffusion model's
stack with canvas steps (`DiffusionTokenOracle`, `--denoise-tokens-per-step`). Without `--rates` each stack runs the
traffic once; with it, each runs it at every rate (the traffic's `rate` replaced) and the
report adds each stack's capacity: the highest rate whose SLO attainment stays at or above
`--min-attainment` at every lower rate. Writes JSON (`--out`) and a PNG (`--plot`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from tandem.config_resolution import default_stack
from tandem.core.plugin_manager import implemented_hooks
from tandem.core.worker.virtual_device import EngineTime
from tandem.plugin_discovery import load_plugin_class
from tandem.schema.config import EngineConfig, PluginSpec
from tandem.simulate.driver import SimulationResult, simulate
from tandem.simulate.report import (
    Slo,
    latency_samples,
    max_rate_under_slo,
    plot_comparison,
    print_table,
    summarize,
    usage_series,
)
from tandem.simulate.traffic import ClosedLoopClients, TrafficSpec, generate, parse_traffic
from tandem.stack_file import load_config

#: Fraction of device memory the KV pool and weights may take (vLLM's default utilisation).
MEMORY_UTILIZATION = 0.9


#: The engine CPU time per step `--engine-time modelled` charges unless given: about what
#: tandem's reference scheduler spends per step and per scheduled request on this class of
#: host (`benchmarks/simulate_scale.py` profiles it; `tandem simulate calibrate` fits it).
DEFAULT_ENGINE_TIME = {"step_s": 5e-4, "per_request_s": 2e-5}


def parse_engine_time(text: str) -> EngineTime:
    """`modelled[:step=S,per_request=S,output=S]` (unset keys: `DEFAULT_ENGINE_TIME`) or
    `measured[:scale=X,output=S]`; `output`: `EngineTime.output_s`, the seconds from a
    step's end to the client seeing its tokens (default 0)."""
    mode, _, rest = text.partition(":")
    keys = {
        "step": "step_s",
        "per_request": "per_request_s",
        "scale": "scale",
        "output": "output_s",
    }
    values: dict[str, float] = dict(DEFAULT_ENGINE_TIME) if mode == "modelled" else {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        if key not in keys:
            raise ValueError(f"--engine-time: unknown key {key!r}; expected {sorted(keys)}")
        try:
            values[keys[key]] = float(raw)
        except ValueError:
            raise ValueError(f"--engine-time: {key!r} must be a number, got {raw!r}") from None
    return EngineTime(mode=mode, **values)


def stack_config(path: str, args: argparse.Namespace) -> EngineConfig:
    """The stack file with the simulation's model length, KV pool and cost model."""
    config = load_config(path)
    diffusion = config.diffusion is not None or is_diffusion_shape(args)
    config.model.model = "scripted-diffusion" if diffusion else "scripted"
    config.model.max_model_len = args.max_model_len
    if config.plugins is None:
        config.plugins = default_stack(config)
    if not any(
        "step_cost" in implemented_hooks(spec.plugin or load_plugin_class(spec.name))
        for spec in config.plugins
    ):
        config.plugins.append(PluginSpec(name="roofline-cost", options=cost_options(args)))
    if config.cache.num_kv_blocks is None:
        config.cache.num_kv_blocks = kv_blocks(args, config.cache.block_size)
    return config


def is_diffusion_shape(args: argparse.Namespace) -> bool:
    """Whether `--model` / `--model-config` is a block-diffusion model (its `model_type`)."""
    from tandem.plugins.cost_models.shapes import NAMED_MODEL_CONFIGS

    if args.model_config:
        config = json.loads(Path(args.model_config).read_text())
    else:
        config = NAMED_MODEL_CONFIGS.get(args.model, {})
    return str(config.get("model_type") or "").startswith("diffusion")


def cost_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"device": args.device}
    if args.model_config:
        options["model_config_path"] = args.model_config
    else:
        options["model"] = args.model
    return options


def kv_blocks(args: argparse.Namespace, block_size: int) -> int:
    """Blocks the device holds after the weights, at `MEMORY_UTILIZATION` (per rank: weights
    and KV heads split over tp, layers over pp)."""
    from tandem.plugins.cost_models.shapes import ModelShape, device_spec, model_shape

    device = device_spec(args.device)
    if args.model_config:
        config = json.loads(Path(args.model_config).read_text())
        shape = ModelShape.from_hf_config(config, name=Path(args.model_config).stem)
    else:
        shape = model_shape(args.model)
    ranks = args.tp * args.pp
    free = device.mem_bytes * MEMORY_UTILIZATION - shape.resident_bytes() / ranks
    per_block = shape.kv_bytes_per_token() / ranks * block_size
    if free <= per_block:
        raise ValueError(
            f"--device {args.device}: {device.mem_bytes / 1e9:.0f} GB cannot hold "
            f"{args.model}'s weights ({shape.resident_bytes() / 1e9:.1f} GB) on {ranks} rank(s)"
        )
    return int(free // per_block)


def run_stack(
    config: EngineConfig, spec: TrafficSpec, args: argparse.Namespace, bar: Any
) -> SimulationResult:
    traffic = (
        ClosedLoopClients(spec, args.max_model_len)
        if spec.kind == "closed"
        else generate(spec, args.max_model_len)
    )
    return simulate(
        config,
        traffic,
        engine_time=args.engine_time,
        acceptance_rate=args.acceptance,
        parallel=(args.tp, args.pp),
        overlap=not args.inline_device,
        progress=bar.update,
        seed=spec.seed,
        denoise_tokens_per_step=args.denoise_tokens_per_step,
    )


def summary_of(result: SimulationResult, slo: Slo) -> dict[str, Any]:
    summary = summarize(
        result.timelines,
        duration_s=result.duration_s,
        slo=slo,
        usage=result.usage,
        device_busy_s=result.busy_s,
        num_preemptions=result.num_preemptions,
    )
    return summary | {
        "wall_s": result.wall_s,
        "simulated_s_per_wall_s": result.duration_s / max(result.wall_s, 1e-9),
        "num_steps": result.num_steps,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem simulate", description=__doc__.split("\n")[0])
    p.add_argument("--stack", action="append", required=True, help="stack YAML (repeatable)")
    p.add_argument("--name", action="append", help="a name per --stack (default: file stem)")
    p.add_argument("--traffic", required=True, help="traffic spec (tandem.simulate.traffic)")
    p.add_argument("--rates", help="comma list of rates: a sweep replacing the traffic's rate")
    p.add_argument("--model", default="llama-3-8b", help="a named model shape")
    p.add_argument("--model-config", help="a config.json for the model shape instead")
    p.add_argument("--device", default="h100", help="a100, h100, h200, b200 or cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument(
        "--engine-time",
        default="modelled",
        help="modelled[:step=S,per_request=S,output=S] (the default; unset keys: "
        "step=0.0005, per_request=0.00002, output=0) or measured[:scale=X,output=S]; "
        "output: seconds from a step's end to the client seeing its tokens",
    )
    p.add_argument(
        "--inline-device",
        action="store_true",
        help="the device is the engine's own thread (a CPU engine on the inprocess "
        "executor): engine and device time never overlap",
    )
    p.add_argument("--acceptance", type=float, default=0.0, help="draft acceptance rate")
    p.add_argument(
        "--denoise-tokens-per-step",
        type=int,
        help="diffusion: canvas positions fixed per denoising step (default: every canvas "
        "takes diffusion.max_denoising_steps)",
    )
    p.add_argument("--slo-ttft-ms", type=float)
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--slo-e2e-ms", type=float)
    p.add_argument("--min-attainment", type=float, default=0.9)
    p.add_argument("--out", type=Path, help="results JSON")
    p.add_argument("--plot", type=Path, help="side-by-side PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "calibrate":
        from tandem.simulate.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    args = parser().parse_args(argv)
    args.engine_time = parse_engine_time(args.engine_time)
    names = args.name or [Path(s).stem for s in args.stack]
    if len(names) != len(args.stack):
        raise ValueError("--name: give one per --stack, or none")
    spec = parse_traffic(args.traffic)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [None]
    if args.rates and spec.kind not in ("poisson", "gamma"):
        raise ValueError(f"--rates: sweeps a poisson or gamma traffic, not {spec.kind!r}")
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    configs = {name: stack_config(path, args) for name, path in zip(names, args.stack, strict=True)}
    from tqdm import tqdm

    results, cdfs, sweeps = {}, {}, {}
    total = spec.num_requests * len(rates) * len(configs) if spec.num_requests else None
    with tqdm(total=total, unit="req", disable=args.quiet, file=sys.stderr, mininterval=1) as bar:
        for name, config in configs.items():
            points = []
            for rate in rates:
                run_spec = spec if rate is None else dataclasses.replace(spec, rate=rate)
                bar.set_description(f"{name}" + ("" if rate is None else f" @ {rate:g}/s"))
                result = run_stack(config, run_spec, args, bar)
                summary = summary_of(result, slo)
                points.append((rate, summary))
            results[name] = points[-1][1] | {"usage": usage_series(result.usage)}
            cdfs[name] = latency_samples(result.timelines)
            if args.rates:
                sweeps[name] = points
    document: dict[str, Any] = {
        "traffic": args.traffic,
        "model": args.model_config or args.model,
        "device": args.device,
        "tp": args.tp,
        "pp": args.pp,
        "engine_time": dataclasses.asdict(args.engine_time),
        "slo": dataclasses.asdict(slo),
        "stacks": results,
    }
    if args.rates:
        document["sweeps"] = {n: [{"rate": r, **s} for r, s in pts] for n, pts in sweeps.items()}
        document["capacity_rate"] = {
            n: max_rate_under_slo(pts, args.min_attainment) for n, pts in sweeps.items()
        }
    print_table(results)
    if args.rates:
        for n, rate in document["capacity_rate"].items():
            print(f"{n}: capacity {rate if rate is not None else '-'} req/s under the SLO")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1))
    if args.plot:
        title = args.traffic + (f" (CDFs and KV at rate {rates[-1]:g})" if args.rates else "")
        plot_comparison(results, args.plot, cdfs=cdfs, sweeps=sweeps or None, title=title)
    return 0
