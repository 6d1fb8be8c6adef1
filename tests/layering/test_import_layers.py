"""The packages read bottom to top: each imports only the layers below it (DESIGN.md §2).

Every `import` in every module counts, including imports inside functions and under
`TYPE_CHECKING`: a lazy import of a higher layer is still a dependency on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom layer first: (package, folder). A package may import itself and every package of
#: a lower layer; packages of one layer may not import each other.
LAYERS: list[list[tuple[str, str]]] = [
    [("tandem.schema", "tandem/schema")],
    [("tandem.kv", "kv")],
    [("tandem.core", "core")],
    [("tandem.models", "models")],
    [("tandem.spec_decode", "spec_decode"), ("tandem.structured_output", "structured_output")],
    # The default sampler verifies drafts with spec_decode's rejection sampler.
    [("tandem.plugins", "plugins")],
]
LOWER_PACKAGES = [name for layer in LAYERS for name, _ in layer]


def _package_of(module: str) -> str:
    """The layered package `module` belongs to, or "front door" for the rest of `tandem`."""
    for name in LOWER_PACKAGES:
        if module == name or module.startswith(name + "."):
            return name
    return "front door"


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("tandem")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tandem":  # `from tandem import X`: X is a module or a name
                found += [(node.lineno, f"tandem.{a.name}") for a in node.names]
            elif node.module.startswith("tandem."):
                found.append((node.lineno, node.module))
    return found


def _cases() -> list[tuple[str, str, int]]:
    return [(name, folder, rank) for rank, layer in enumerate(LAYERS) for name, folder in layer]


@pytest.mark.parametrize(("package", "folder", "rank"), _cases(), ids=lambda v: str(v))
def test_a_package_imports_only_the_layers_below_it(package: str, folder: str, rank: int) -> None:
    allowed = {package} | {name for layer in LAYERS[:rank] for name, _ in layer}
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"{folder} has no modules"
    upward = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in files
        for line, module in _imports(path)
        if _package_of(module) not in allowed
    ]
    assert not upward, f"{package} imports a layer above it:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from tandem.llm import LLM\n    import tandem.models.hf_model\n"
    )
    modules = [module for _, module in _imports(source)]
    assert [_package_of(m) for m in modules] == ["front door", "tandem.models"]


def test_core_worker_keeps_only_the_worker_side_of_the_kernel() -> None:
    """Models, layers and compiled model kernels live in tandem.models, not in the kernel."""
    worker = ROOT / "core" / "worker"
    model_like = [
        p.name
        for p in worker.glob("*.py")
        if any(word in p.stem for word in ("linear", "attention", "gemma", "hf_", "decoder"))
    ]
    assert model_like == []
    assert sorted(p.name for p in (worker / "csrc").glob("*.cpp")) == ["omp_affinity.cpp"]
