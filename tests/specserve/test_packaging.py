"""pyproject.toml declares every package it installs: a folder that is not declared is left out of a
non-editable install (the Docker image) and makes `pip install` warn."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def _folder(package: str, package_dir: dict[str, str]) -> Path:
    """The source folder of a dotted package name under the package-dir mapping."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in package_dir:
            return ROOT / package_dir[head] / Path(*parts[i:])
    return ROOT / Path(*parts)


def _name(folder: Path, package_dir: dict[str, str]) -> str:
    """The dotted package name of a source folder (the longest package-dir root that holds it)."""
    roots = sorted(package_dir.items(), key=lambda kv: -len(Path(kv[1]).parts))
    for package, root in roots:
        rel = folder.relative_to(ROOT)
        if rel.parts[: len(Path(root).parts)] == Path(root).parts:
            return ".".join([package, *rel.parts[len(Path(root).parts):]])
    raise AssertionError(f"{folder} is under no package-dir root")


def test_every_package_data_folder_is_a_declared_package():
    cfg = _setuptools()
    packages, package_dir = set(cfg["packages"]), cfg["package-dir"]
    for package, patterns in cfg["package-data"].items():
        assert package in packages, f"package-data names {package}, which is not in packages"
        folder = _folder(package, package_dir)
        matched = [f for pattern in patterns for f in folder.glob(pattern)]
        assert matched, f"package-data {package}: {patterns} match no file under {folder}"
        for file in matched:
            name = _name(file.parent, package_dir)
            assert name in packages, f"{file.relative_to(ROOT)} is data of {name}, which packages does not declare"


def test_every_python_folder_is_a_declared_package():
    cfg = _setuptools()
    packages, package_dir = set(cfg["packages"]), cfg["package-dir"]
    for package in packages:
        assert _folder(package, package_dir).is_dir(), f"declared package {package} has no folder"
    for root in set(package_dir.values()):
        for init in (ROOT / root).rglob("*.py"):
            if "__pycache__" in init.parts:
                continue
            name = _name(init.parent, package_dir)
            assert name in packages, f"{init.relative_to(ROOT)} is in {name}, which packages does not declare"
