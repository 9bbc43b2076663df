"""What the numbers were measured on: device, driver, library versions, and which code: the project's
version, a hash of its own source files, and its git commit when the source folder is a git checkout's
top level ("unknown" otherwise: a copy of the tree without .git must not record the commit of whatever
repository happens to enclose it), or the commit the environment says (``SPECSERVE_GIT_COMMIT``, for a copy whose
own .git is stale, such as the GPU machine's)."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import torch

PACKAGES = ("torch", "triton", "flashinfer-python", "transformers", "numpy", "specserve")
REPO_ROOT = Path(__file__).resolve().parents[2]
# The project's packages (pyproject's package-dir roots); their *.py and *.proto files are its source.
SOURCE_PACKAGES = (
    "specserve",
    "specserve.gateway",
    "specserve.draft_service",
    "specserve.target_service",
    "specserve.kernels",
    "specserve.protos",
)
SOURCE_SUFFIXES = (".py", ".proto")
UNKNOWN = "unknown"
# The commit the run is of, as `git describe --always --dirty` prints it where the tree was copied from; it
# overrides what the source folder's own .git says (a copy of the tree can carry a stale history).
GIT_COMMIT_ENV = "SPECSERVE_GIT_COMMIT"
_GIVEN_COMMIT = re.compile(r"(?P<commit>[0-9a-fA-F]{7,40})(?P<dirty>-dirty)?")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: a busy machine makes CPU timings noisy, so the run records it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def given_commit(value: str) -> dict:
    """{commit, dirty, source} of a SPECSERVE_GIT_COMMIT value: a commit id, "-dirty" when the tree had changes."""
    match = _GIVEN_COMMIT.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"{GIT_COMMIT_ENV}: {value[:60]!r} is not a commit (7 to 40 hex digits, then -dirty or "
            "nothing: what `git describe --always --dirty` prints)"
        )
    return {"commit": match["commit"].lower(), "dirty": match["dirty"] is not None, "source": GIT_COMMIT_ENV}


def git_state(root: Path = REPO_ROOT, environ: Mapping[str, str] | None = None) -> dict:
    """{commit, dirty} of the git checkout whose top level is ``root``; commit "unknown" (dirty None) when
    root is not one (no .git of its own, even inside another repository, or no git). With SPECSERVE_GIT_COMMIT
    set (non-empty) in ``environ`` (os.environ by default): that commit instead, whatever .git says (given_commit)."""
    given = (os.environ if environ is None else environ).get(GIT_COMMIT_ENV)
    if given:
        return given_commit(given)
    top = _run(["git", "rev-parse", "--show-toplevel"], root) if (root / ".git").exists() else None
    if top is None or Path(top).resolve() != root.resolve():
        return {"commit": UNKNOWN, "dirty": None}
    commit = _run(["git", "rev-parse", "HEAD"], root)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit or UNKNOWN, "dirty": bool(dirty) if commit else None}


def source_folders() -> list[Path]:
    """The folders of the project's packages as imported (an editable checkout or an installed copy)."""
    folders = []
    for name in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(Path(p).resolve() for p in spec.submodule_search_locations)
    return sorted(set(folders))


def source_sha256(folders: list[Path]) -> str:
    """sha256 over (path relative to its folder's parent, contents) of every source file, in path order: the
    same tree gives the same hash wherever it lies, with or without .git; one edited byte changes it."""
    digest = hashlib.sha256()
    files = sorted(
        (f.relative_to(folder.parent).as_posix(), f)
        for folder in folders
        for f in folder.rglob("*")
        if f.suffix in SOURCE_SUFFIXES and f.is_file() and "__pycache__" not in f.parts
    )
    for rel, f in files:
        data = f.read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def environment(device: str, bandwidth: dict | None = None) -> dict:
    """The run's machine and code; `bandwidth` the copy bandwidth it measured (bandwidth.CopyBandwidth.as_dict), if
    any."""
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load_average(),
        "versions": {**{p: _version(p) for p in PACKAGES}, "cuda": torch.version.cuda},
        "specserve": {"version": _version("specserve") or UNKNOWN, "source_sha256": source_sha256(source_folders())},
        "git": git_state(),
        "device": device,
        "gpu": None,
        "bandwidth": bandwidth,
    }
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        env["gpu"] = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "driver": _run(["nvidia-smi", f"--id={idx}", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "cuda_runtime": torch.version.cuda,
        }
    return env
