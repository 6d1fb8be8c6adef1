"""The `tandem` command line.

tandem plugins list                 installed plugins: name, distribution, version, declared
                                    capabilities, hooks, options; installed model loaders
tandem plugins show NAME            one plugin's docs and option defaults
tandem config show [STACK.yaml]     the resolved stack: order, who answers each hook, options
tandem generate PROMPT...           generate (token ids with --token-ids on the scripted model)
tandem serve [MODEL]                the OpenAI-compatible HTTP server (tandem.server)

The parser imports nothing heavy: each command imports what it needs when it runs, so
`tandem --help` answers at once (torch and transformers load only for a model).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tandem.server.serve_flags import add_serve_flags


def _call_rank(cls: type, hook: str) -> int:
    """Where pluggy calls a class's implementation of `hook`: 0 `tryfirst`, 1 plain,
    2 `trylast` (in stack order within a rank), so the first answer has the lowest rank."""
    opts = getattr(getattr(cls, hook), "tandem_impl", None) or {}
    return 0 if opts.get("tryfirst") else 2 if opts.get("trylast") else 1


def _firstresult_hooks() -> set[str]:
    from tandem.core.hookspecs import EngineHookSpecs, WorkerHookSpecs

    names = set()
    for specs in (EngineHookSpecs, WorkerHookSpecs):
        for name, fn in vars(specs).items():
            opts = getattr(fn, "tandem_spec", None)
            if opts and opts.get("firstresult"):
                names.add(name)
    return names


def _declared(cls: type) -> str:
    """The capabilities a plugin class declares (those differing from the defaults)."""
    from tandem.core.plugin_manager import CAPABILITIES, TandemPlugin, capability

    found = {name: capability(cls, name) for name in CAPABILITIES}
    shown = [
        f"{name}={', '.join(value) if isinstance(value, tuple) else value}"
        for name, value in found.items()
        if value != getattr(TandemPlugin, name)
    ]
    return "; ".join(shown) or "-"


def cmd_plugins_list(args: argparse.Namespace) -> int:
    """Every installed plugin with its declared capabilities; one that fails to import
    (even by calling `sys.exit`) is listed as broken, with its error, and the others are
    still listed. Then the installed model loaders and the kinds they declare."""
    from tandem.core.plugin_manager import implemented_hooks
    from tandem.core.worker.model_loader import model_loaders
    from tandem.plugin_discovery import discover_plugins, load_plugin_class

    broken = []
    for name, info in sorted(discover_plugins().items()):
        try:
            cls = load_plugin_class(name)
            hooks = ", ".join(sorted(implemented_hooks(cls)))
            declares = _declared(cls)
            options = getattr(cls, "Options", None)
            schema = (
                json.dumps(options.model_json_schema().get("properties", {})) if options else "{}"
            )
        except Exception as exc:  # import errors arrive as ConfigError; a bad Options model too
            hooks, declares, schema = f"ERROR: {exc}", "-", "-"
            broken.append(name)
        print(f"{name}  ({info.distribution} {info.version})  [{info.value}]")
        print(f"    hooks:    {hooks}")
        print(f"    options:  {schema}")
        print(f"    declares: {declares}")
    for kind, loader in sorted(model_loaders().items()):
        tokenizer = "with tokenizer" if loader.has_tokenizer else "no tokenizer"
        print(f"model loader {kind}: {loader.__module__}:{loader.__qualname__} ({tokenizer})")
    if broken:
        print(f"tandem: broken plugin(s), not usable: {', '.join(broken)}", file=sys.stderr)
    return 0


def cmd_plugins_show(args: argparse.Namespace) -> int:
    from tandem.core.plugin_manager import implemented_hooks
    from tandem.plugin_discovery import load_plugin_class

    cls = load_plugin_class(args.name)
    print(f"{args.name}: {cls.__module__}.{cls.__qualname__}")
    print((sys.modules[cls.__module__].__doc__ or "").strip())
    print()
    print((cls.__doc__ or "").strip())
    options = getattr(cls, "Options", None)
    if options is not None:
        print("\noptions (defaults):")
        print(json.dumps(options().model_dump(), indent=2, default=str))
    print("\ndeclares:", _declared(cls))
    print("hooks:", ", ".join(sorted(implemented_hooks(cls))))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from tandem.config_resolution import resolve_config
    from tandem.core.plugin_manager import implemented_hooks, stack_of
    from tandem.stack_file import load_config

    config = resolve_config(load_config(args.stack, **_overrides(args)))
    source = args.stack or "<defaults>"
    resolved = stack_of(config)
    firstresult = _firstresult_hooks()
    print(f"# resolved stack from {source}")
    print(f"# {_threads_line(config)}")
    print(json.dumps(config.model_dump(exclude={"plugins", "resolved_stack"}), indent=2))
    print("plugins (call order):")
    answers: dict[str, list[tuple[int, int, str]]] = {}
    for i, entry in enumerate(resolved.entries):
        hooks = sorted(implemented_hooks(entry.cls))
        for hook in hooks:
            if hook in firstresult:
                answers.setdefault(hook, []).append((_call_rank(entry.cls, hook), i, entry.name))
        options = json.dumps(entry.options.model_dump(), default=str)
        print(f"  {i}. {entry.name}  options={options}")
        print(f"     hooks: {', '.join(hooks)}")
        print(f"     declares: {_declared(entry.cls)}")
    print("firstresult hooks answered by:")
    for hook in sorted(firstresult):
        print(f"  {hook}: {min(answers[hook])[2] if hook in answers else '(nobody)'}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    llm = LLM(model=args.model, config=args.config, **_overrides(args))
    print(f"tandem: {_threads_line(llm.config)}", file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p
    )
    prompts: list[Any]
    if args.token_ids:
        prompts = [[int(t) for t in p.replace(",", " ").split()] for p in args.prompts]
    else:
        prompts = list(args.prompts)
    for out in llm.generate(prompts, params, use_tqdm=len(prompts) > 1):
        completion = out.outputs[0]
        print(
            json.dumps(
                {
                    "prompt": out.prompt,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                }
            )
        )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat on stdin: one user message per line, empty line or EOF to quit."""
    from tandem import LLM, SamplingParams

    llm = LLM(model=args.model, config=args.config, **_overrides(args))
    print(f"tandem: {_threads_line(llm.config)}", file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    while True:
        try:
            line = input("you> ") if sys.stdin.isatty() else sys.stdin.readline()
        except EOFError:
            break
        line = line.strip()
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text.strip()
        history.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}", flush=True)
    return 0


def _threads_line(config: Any) -> str:
    """The worker's resolved torch threads and where the number came from."""
    from tandem.core.executor import executor_class

    parallel = config.parallel
    where = (
        "the caller's process"
        if executor_class(parallel.executor).runs_in_caller_process
        else "its process"
    )
    return (
        f"worker threads: {parallel.worker_num_threads} (from {parallel.worker_threads_from}; "
        f"{parallel.executor} executor: {where})"
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "block_size",
        "num_kv_blocks",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "dtype",
        "quantization",
    )
    out = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "async_scheduling", None) is not None:
        out["async_scheduling"] = args.async_scheduling
    if getattr(args, "threads", None) is not None:
        out["worker_num_threads"] = args.threads
    if getattr(args, "download", False):
        out["allow_download"] = True
    if getattr(args, "kv_transfer_config", None) is not None:
        out["kv_transfer_config"] = args.kv_transfer_config
    return out


def _json_object(text: str) -> dict[str, Any]:
    """A command-line JSON object (argparse names the flag in its error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


#: `model.dtype` and `model.quantization`'s values, spelled here so the parser stays free of
#: the schema's import (a test holds them equal to `tandem.schema.config.ModelConfig`'s).
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "awq", "gptq")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, help="longest sequence (prompt + output)")
    p.add_argument("--block-size", type=int, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, help="explicit KV pool size in blocks")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA; bfloat16 on "
        "a CPU with bf16 units is the fastest at large batches, docs/cpu-performance.md)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATIONS,
        help="auto: a GGUF's Q4/Q8 weights stay quantized; none: every weight in --dtype; "
        "int8 / int4: quantized at load (docs/quantization.md)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        help="split every layer across this many worker processes (docs/parallel.md)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        help="run the layers as this many stages, one worker process each",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="the worker's torch threads (default: OMP_NUM_THREADS if set, else the CPUs "
        "this process may use)",
    )
    p.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        help='vLLM\'s KV connector JSON, e.g. \'{"kv_connector": "OffloadingConnector", '
        '"kv_connector_extra_config": {"cpu_blocks": 4096}}\' (docs/kv-connectors.md)',
    )
    p.add_argument(
        "--download",
        action="store_true",
        help="download a Hugging Face hub model missing from the local hub cache (off: "
        "nothing downloads by default)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--async-scheduling",
        dest="async_scheduling",
        action="store_true",
        default=None,
        help="plan step t+1 while step t runs (default: on when compatible)",
    )
    group.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="the synchronous loop",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="tandem: a plugin-architected LLM inference engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="installed plugins").add_subparsers(
        dest="action", required=True
    )
    plugins.add_parser(
        "list", help="every installed plugin with its hooks and option schema"
    ).set_defaults(fn=cmd_plugins_list)
    show = plugins.add_parser("show", help="one plugin's documentation and option defaults")
    show.add_argument("name")
    show.set_defaults(fn=cmd_plugins_show)

    config = sub.add_parser("config", help="stack files").add_subparsers(
        dest="action", required=True
    )
    cshow = config.add_parser("show", help="print the resolved stack: order, hook answers, options")
    cshow.add_argument("stack", nargs="?", help="YAML stack file (default: built-in defaults)")
    _engine_flags(cshow)
    cshow.set_defaults(fn=cmd_config_show)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", help="prompt texts (or token ids with --token-ids)")
    gen.add_argument(
        "--model",
        help="model: 'default', 'scripted', an HF directory, a .gguf file or a hub id "
        "(org/name, from the local Hugging Face cache)",
    )
    gen.add_argument("--config", help="YAML stack file")
    gen.add_argument(
        "--token-ids", action="store_true", help="prompts are space/comma separated token ids"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--max-tokens", type=int, default=64, help="most output tokens per prompt")
    gen.add_argument("--seed", type=int, help="per-request seed")
    _engine_flags(gen)
    gen.set_defaults(fn=cmd_generate)

    chat = sub.add_parser("chat", help="chat on stdin with the model's chat template")
    chat.add_argument(
        "--model",
        help="model: 'default', an HF directory, a .gguf file or a hub id (org/name, from "
        "the local Hugging Face cache)",
    )
    chat.add_argument("--config", help="YAML stack file")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    chat.add_argument("--seed", type=int, help="per-request seed")
    _engine_flags(chat)
    chat.set_defaults(fn=cmd_chat)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (tandem.server)")
    add_serve_flags(serve)
    _engine_flags(serve)
    serve.set_defaults(fn=cmd_serve)

    trace = sub.add_parser(
        "trace", help="sync and async timelines on the simulated device (JSON + PNG)"
    )
    trace.add_argument(
        "rest", nargs=argparse.REMAINDER, help="options of tandem.trace (--out, --requests, ...)"
    )

    sub.add_parser("simulate", help="stacks side by side on a simulated device, on a virtual clock")
    bench = sub.add_parser("bench", help="benchmarks against peers (same weights, same token ids)")
    bench.add_argument(
        "kind",
        choices=["throughput", "latency", "serve", "accuracy"],
        help="default workload, 1-request latency workload, `serve`: request rates "
        "against a running OpenAI-compatible server (tandem.bench_serve), or `accuracy` "
        "(also `tandem bench --accuracy`): quantizations against the float model "
        "(tandem.accuracy)",
    )
    bench.add_argument(
        "rest", nargs=argparse.REMAINDER, help="options of tandem.bench (--peers, --threads, ...)"
    )
    bench.set_defaults(fn=cmd_bench)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    if args.disaggregated:
        from tandem.server.disagg import run_disaggregated

        return run_disaggregated(args, args.argv[args.argv.index("serve") + 1 :])
    from tandem.server.api_server import run_server

    return run_server(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from tandem.bench import main as bench_main

    rest = list(args.rest)
    if args.kind == "serve":
        from tandem.bench_serve import main as bench_serve_main

        return bench_serve_main(rest)
    if args.kind == "accuracy":
        return bench_main(["--accuracy", *rest])
    if not any(a.startswith("--workload") for a in rest):
        rest = ["--workload", "default" if args.kind == "throughput" else "latency", *rest]
    return bench_main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["trace"]:  # its own parser, `--help` included
        from tandem.trace import main as trace_main

        return trace_main(argv[1:])
    if argv[:1] == ["simulate"]:  # its own parser, `--help` included
        from tandem.simulate.cli import main as simulate_main

        try:
            return simulate_main(argv[1:])
        except ValueError as exc:
            print(f"tandem simulate: error: {exc}", file=sys.stderr)
            return 2
    if argv[:2] == ["bench", "--accuracy"]:  # the flag in place of a workload kind
        argv = ["bench", "accuracy", *argv[2:]]
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --disaggregated` passes its flags on to its servers
    from tandem.schema.config import ConfigError

    try:
        return args.fn(args)
    except (ConfigError, ValueError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        # Raised from inside the engine, so its modules are loaded: no import cost here.
        from tandem.core.engine_core import EngineDeadError
        from tandem.core.plugin_error import PluginError

        if not isinstance(exc, (EngineDeadError, PluginError)):
            raise
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
