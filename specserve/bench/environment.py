"""What the numbers were measured on: device, driver, library versions, git commit."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

PACKAGES = ("torch", "triton", "flashinfer-python", "transformers", "numpy", "specserve")
REPO_ROOT = Path(__file__).resolve().parents[2]


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


def git_state() -> dict:
    commit = _run(["git", "rev-parse", "HEAD"], REPO_ROOT)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    return {"commit": commit, "dirty": bool(dirty) if commit else None}


def environment(device: str) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": load_average(),
        "versions": {p: _version(p) for p in PACKAGES},
        "git": git_state(),
        "device": device,
        "gpu": None,
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
