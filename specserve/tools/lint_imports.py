"""`python -m specserve.tools.lint_imports`: check the import-linter contracts of pyproject.toml.

The distribution maps top-level folders into one package (`gateway/` is `specserve.gateway`, and so on: see
[tool.setuptools] package-dir), which import-linter cannot see on disk. So this stages the Python files as the
installed package tree under build/lint/ and runs `lint-imports` there; its report names any offending import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stage(out: Path) -> Path:
    """Copy every .py file to where the installed package has it; returns the folder to put on PYTHONPATH."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(out, ignore_errors=True)
    for package, folder in mapping.items():
        src = ROOT / folder
        dst = out.joinpath(*package.split("."))
        for path in src.rglob("*.py"):
            rel = path.relative_to(src)
            if "__pycache__" in rel.parts:
                continue
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return out


def main() -> int:
    staged = stage(ROOT / "build" / "lint")
    env = dict(os.environ, PYTHONPATH=str(staged))
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.call([str(exe), str(ROOT / "pyproject.toml")], cwd=staged, env=env)


if __name__ == "__main__":
    sys.exit(main())
