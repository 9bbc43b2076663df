"""The import graph has no cycle between specserve's modules, function-level imports included
(specserve/tools/import_cycles.py; issue #45 found two: dflash <-> scaled_drafters, mtp <-> scaled_mtp)."""

from __future__ import annotations

import shutil
from pathlib import Path

from specserve.tools.import_cycles import ROOT, tree_cycles


def test_no_import_cycles_function_level_included():
    assert tree_cycles(ROOT, top_only=False) == []


def test_a_function_level_cycle_is_found(tmp_path: Path):
    """A cycle made only by an import inside a function counts with every import, not at module level."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("specserve", "gateway", "draft_service", "target_service", "kernels", "protos"):
        (tmp_path / folder).mkdir()
    (tmp_path / "specserve" / "__init__.py").write_text("")
    (tmp_path / "gateway" / "__init__.py").write_text("")
    (tmp_path / "gateway" / "a.py").write_text("from specserve.gateway import b\n")
    (tmp_path / "gateway" / "b.py").write_text("def f():\n    from specserve.gateway.a import g\n")
    assert tree_cycles(tmp_path, top_only=True) == []
    assert tree_cycles(tmp_path, top_only=False) == [["specserve.gateway.a", "specserve.gateway.b"]]
