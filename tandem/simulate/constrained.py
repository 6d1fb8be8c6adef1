"""Constrained requests in `tandem simulate`: JSON schemas in the traffic, a tokenizer for
grammar stacks.

Traffic: `json=F` gives a fraction F of the requests a JSON-schema constraint
(`structured_outputs.json`), each drawn uniformly from `BUILTIN_SCHEMAS` (four schemas from
a one-field flag to a nested order with bounded strings and arrays: their compile times
differ, and the compile cache decides how often one is paid) or from `schema=PATH` (a JSON
file holding one schema or a list of schemas). `SchemaPicker` draws from its own seeded
stream, after the request's shape, so a spec with and without `json` gives the same
arrivals and lengths. A constrained request is generated at most to its traffic length:
the token oracle picks tokens its grammar allows and emits EOS only when the grammar
allows nothing else, so the request stops there ("stop") or runs to its length.

Tokenizer: the simulated model is the scripted one, which has no tokenizer, and a grammar
backend compiles against a vocabulary. `grammar_tokenizer` gives a stack with a grammar
plugin (role "grammar") the embedded SmolLM2's tokenizer (`model.tokenizer`, resolved
offline by `models.model_files`) and that tokenizer's `vocab_size` and `eos_token_id`, so
masks, prompts and the oracle's choices share one vocabulary; a stack that names its own
`model.tokenizer` keeps it.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from tandem.schema.config import EngineConfig

_T = TypeVar("_T")

#: Built-in schemas, smallest first (names are for docs and tests only).
BUILTIN_SCHEMAS: dict[str, dict[str, Any]] = {
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    "tagged": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["a", "b", "c"]},
        },
        "required": ["x", "tag"],
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "tier": {"enum": ["free", "pro", "team", "enterprise"]},
                },
                "required": ["name", "tier"],
            },
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["new", "paid", "shipped", "delivered", "returned"]},
            "note": {"type": "string", "maxLength": 40},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "country": {"enum": ["US", "CA", "MX", "DE", "FR", "JP"]},
                },
                "required": ["city", "country"],
            },
        },
        "required": ["id", "customer", "items", "status"],
    },
}


def _compact(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))


def load_schemas(path: str | Path) -> list[str]:
    """The schemas of a `schema=PATH` file (one JSON object, or a non-empty list of them),
    as compact JSON text; ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"traffic: schema: cannot read {path}: {exc}") from None
    schemas = data if isinstance(data, list) else [data]
    if not schemas or not all(isinstance(s, dict) for s in schemas):
        raise ValueError(
            f"traffic: schema: {path} must hold a JSON schema (an object) or a non-empty "
            "list of them"
        )
    return [_compact(s) for s in schemas]


class SchemaPicker:
    """Gives a fraction `fraction` of requests one of `schemas` (JSON text; default the
    built-in set), from the stream `random.Random(f"...json:{seed}")`. With fraction 0
    it draws nothing and changes nothing."""

    def __init__(self, fraction: float, schemas: list[str] | None = None, seed: int = 0) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"traffic: 'json' must be a fraction in [0, 1], got {fraction}")
        self.fraction = fraction
        self.schemas = schemas or [_compact(s) for s in BUILTIN_SCHEMAS.values()]
        self._rng = random.Random(f"tandem.simulate.traffic.json:{seed}")

    @classmethod
    def of(cls, spec: Any) -> SchemaPicker:
        """The picker of a `TrafficSpec` (its `json_fraction`, `schema_path`, `seed`)."""
        path = spec.schema_path
        return cls(spec.json_fraction, load_schemas(path) if path else None, spec.seed)

    def apply(self, request: _T) -> _T:
        """`request` (a `TrafficRequest`), constrained by a schema with probability
        `fraction` (its `json_schema` set), else unchanged."""
        if self.fraction == 0.0 or self._rng.random() >= self.fraction:
            return request
        return dataclasses.replace(request, json_schema=self._rng.choice(self.schemas))


def has_grammar_plugin(config: EngineConfig) -> bool:
    """Whether the config's stack names a plugin of role "grammar"."""
    from tandem.core.plugin_manager import capability
    from tandem.plugin_discovery import load_plugin_class

    classes = [
        spec.plugin
        if isinstance(spec.plugin, type)
        else load_plugin_class(spec.plugin or spec.name)
        for spec in config.plugins or ()
    ]
    return any(capability(cls, "role") == "grammar" for cls in classes)


def grammar_tokenizer(config: EngineConfig) -> None:
    """Give a grammar stack a tokenizer for the simulation, in place (module docstring):
    `model.tokenizer` (default: the embedded SmolLM2), and that tokenizer's vocabulary size
    and EOS id. No change for a stack without a grammar plugin."""
    if not has_grammar_plugin(config):
        return
    from tandem.models.model_files import load_tokenizer, resolve_model_dir

    model = config.model
    if model.tokenizer is None:
        model.tokenizer = str(resolve_model_dir("default"))
    tokenizer = load_tokenizer(Path(model.tokenizer))
    if tokenizer is None:
        raise ValueError(f"model.tokenizer: no tokenizer files in {model.tokenizer}")
    model.vocab_size = len(tokenizer)
    model.eos_token_id = tokenizer.eos_token_id
