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
            return ".".join([package, *rel.parts[len(Path(root).parts) :]])
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


def test_no_artifacts_inside_the_packages():
    """Benchmark artifacts live in benchmarks/results/, outside every package: the package folders hold Python,
    declared package data and a few small notes, so a wheel carries no run's data (issue #45: 22 MB of results
    used to ride along in specserve/bench/)."""
    cfg = _setuptools()
    package_dir = cfg["package-dir"]
    data = {
        f
        for package, patterns in cfg["package-data"].items()
        for pattern in patterns
        for f in _folder(package, package_dir).glob(pattern)
    }
    extra = [
        f
        for root in set(package_dir.values())
        for f in (ROOT / root).rglob("*")
        if f.is_file()
        and "__pycache__" not in f.parts
        and f.suffix not in {".py", ".pyi", ".pyc", ".so"}
        and f not in data
    ]
    total = sum(f.stat().st_size for f in extra)
    biggest = sorted(extra, key=lambda f: -f.stat().st_size)[:3]
    assert total < 256 * 1024, f"{len(extra)} non-Python files ({total} bytes) inside the packages, e.g. " + ", ".join(
        str(f.relative_to(ROOT)) for f in biggest
    )
    assert (ROOT / "benchmarks" / "results").is_dir()
