"""Stack files and keyword overrides: turning YAML and `LLM(**kw)` into an `EngineConfig`.

A stack file is YAML with the config sections (all optional) and `plugins`, the ordered list
of plugins with their options:

    model: {model: scripted, max_model_len: 512}
    scheduler: {max_num_batched_tokens: 256, max_num_seqs: 16}
    cache: {block_size: 16, num_kv_blocks: 128, enable_prefix_caching: true}
    plugins:
      - reference-scheduler                  # an installed plugin's entry-point name
      - name: my_pkg.policy:ShortestFirst    # or a class by its import path module:Class
      - name: default-sampler
        options: {}

`LLM(**kw)` keywords override fields by their (unique) name, e.g. `max_num_seqs=64`; a
whole section by its name or vLLM's: `speculative` / `speculative_config`, `diffusion` /
`diffusion_config`, `kv_transfer` / `kv_transfer_config` (a mapping, e.g.
`diffusion={"canvas_length": 8}`).
Every error names the file, the key path and what was expected. A key written twice in one
mapping is an error (YAML alone would keep the last silently). String values may name
environment variables, `${NAME}` or `${NAME:-fallback}`; `${TANDEM_CACHE}` always resolves
(to `~/.cache/tandem` when unset), e.g. `speculative: {model: ${TANDEM_CACHE}/eagle/head}`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tandem.schema.cache_dir import cache_root
from tandem.schema.config import ConfigError, EngineConfig, SpeculativeConfig, with_line
from tandem.schema.sampling_params import format_validation_error

_SECTIONS = ("model", "scheduler", "cache", "speculative", "structured_output", "parallel")
_TOP_LEVEL = ("plugins", "check_invariants", "trace_hooks", "diffusion", "kv_transfer")
#: vLLM's keyword names for whole sections (`LLM(speculative_config={...})`).
_VLLM_SECTION_NAMES = {
    "speculative_config": "speculative",
    "diffusion_config": "diffusion",
    "kv_transfer_config": "kv_transfer",
}


def _override_target(key: str) -> tuple[str | None, str]:
    """Map a flat keyword (vLLM style) to (section, field); raise for unknown names."""
    if key in _TOP_LEVEL or key in _SECTIONS and key != "model":
        return None, key
    if key in _VLLM_SECTION_NAMES:
        return None, _VLLM_SECTION_NAMES[key]
    for section in _SECTIONS:
        model_cls = EngineConfig.model_fields[section].annotation
        fields = getattr(model_cls, "model_fields", None)
        if fields is None:  # Optional[...] section
            fields = SpeculativeConfig.model_fields
        if key in fields:
            return section, key
    raise ConfigError(f"unknown engine option {key!r}: not a field of any config section")


def yaml_key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """The 1-based line of every mapping key and sequence item of a YAML document, by path."""
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*path, str(key.value))
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*path, i)] = item.start_mark.line + 1
                walk(item, (*path, i))

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return lines


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping key written twice (`line` and `first_line` are 1-based)."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(problem=f"duplicate key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line


class _StackLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges are allowed to repeat keys
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(key, line, first)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


#: `${NAME}` or `${NAME:-fallback}` in a string value of a stack file.
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(
    value: Any, source: str, lines: dict[tuple[str | int, ...], int], path: tuple = ()
) -> Any:
    """`value` with `${NAME}` / `${NAME:-fallback}` replaced in every string, recursively.
    `${TANDEM_CACHE}` falls back to tandem's cache root; any other unset variable without a
    fallback is a `ConfigError` naming the line, the key path and the variable."""
    if isinstance(value, dict):
        return {k: expand_env(v, source, lines, (*path, str(k))) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, source, lines, (*path, i)) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        name, fallback = match.group(1), match.group(2)
        found = os.environ.get(name)
        if found:
            return found
        if fallback is not None:
            return fallback
        if name == "TANDEM_CACHE":
            return str(cache_root())
        key = ".".join(str(p) for p in path) or "<root>"
        raise ConfigError(
            f"{with_line(source, lines, path)}: {key}: environment variable {name} is not set "
            f"(write ${{{name}:-fallback}} to give a default)"
        )

    return _ENV_REFERENCE.sub(substitute, value)


def _read_stack_file(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str | int, ...], int]]:
    """The mapping of a YAML stack file (variables expanded) and the line of each key path."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read stack file ({exc.strerror})") from exc
    try:
        loaded = yaml.load(text, Loader=_StackLoader)  # safe_load, refusing duplicate keys
    except DuplicateKeyError as exc:
        raise ConfigError(
            f"{source}:{exc.line}: duplicate key {exc.key!r} (first written on line "
            f"{exc.first_line}); YAML would silently keep only the last one"
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from exc
    lines = yaml_key_lines(text)
    loaded = expand_env(loaded, source, lines)
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"{source}: <root>: expected a mapping of sections, got {type(loaded).__name__}"
        )
    return loaded, lines


def load_config(path: str | Path | EngineConfig | None = None, **overrides: Any) -> EngineConfig:
    """Read an optional YAML stack file (or start from an `EngineConfig`), apply keyword
    overrides, validate.

    Raises `ConfigError` naming the file, the key path and the expectation for bad YAML,
    an unknown key or a wrong type.
    """
    source = str(path) if isinstance(path, (str, Path)) else "<keywords>"
    data: dict[str, Any] = {}
    lines: dict[tuple[str | int, ...], int] = {}
    if isinstance(path, EngineConfig):
        data = path.model_dump(exclude_unset=True, exclude={"resolved_stack"})
    elif path is not None:
        data, lines = _read_stack_file(path)
    for key, value in overrides.items():
        if value is None:
            continue
        section, field = _override_target(key)
        if section is None:
            data[field] = value
        else:
            target = data.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{source}: {section}: expected a mapping")
            target[field] = value
    try:
        config = EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, lines)) from exc
    config._source = source if isinstance(path, (str, Path)) else getattr(path, "source", source)
    config._lines = dict(path._lines) if isinstance(path, EngineConfig) else lines
    return config
