"""Fixtures for the speculative-decoding tests.

`unaligned_drafter`: a throwaway distribution installs a drafter that declares
`aligned_drafts = False` under the `tandem.plugins` entry point group, as a pip install
would, so config resolution must find it through the stack.

The embedded SmolLM2 fixtures live in tests/model/conftest.py; `smollm2_dir` is re-exported
here so these tests build their own engines on the same converted weights.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PLUGIN_MODULE = """
from typing import ClassVar
from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin


class UnalignedDrafter(TandemPlugin):
    role: ClassVar[str] = "drafter"
    aligned_drafts: ClassVar[bool] = False

    @hookimpl
    def propose_drafts(self, context):
        return [[] for _ in context.req_ids]
"""


@pytest.fixture(scope="session")
def unaligned_drafter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The entry-point name of a drafter plugin whose drafts are not aligned."""
    root: Path = tmp_path_factory.mktemp("spec-plugins")
    (root / "tandem_unaligned_drafter.py").write_text(PLUGIN_MODULE)
    info = root / "tandem_unaligned_drafter-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tandem-unaligned-drafter\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[tandem.plugins]\nunaligned-drafter = tandem_unaligned_drafter:UnalignedDrafter\n"
    )
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield "unaligned-drafter"
    sys.path.remove(str(root))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted HF directory of the embedded SmolLM2 (converted once into the cache)."""
    from tandem.models.model_files import resolve_model_dir

    return resolve_model_dir("default")
