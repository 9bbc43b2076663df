"""Where the shipped demo checkpoints live (the folder demo_model/ at the repository root)."""

from __future__ import annotations

import os
from pathlib import Path

from specserve.errors import SpecserveError

DEMO_ENV = "SPECSERVE_DEMO_DIR"


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_ENV, Path(__file__).resolve().parents[1] / "demo_model"))


def demo_checkpoint(part: str) -> Path:
    """A shipped checkpoint folder: part is 'target' or a drafter family ('model', 'eagle3', 'dflash')."""
    path = demo_dir() / part
    if not (path / "config.json").exists():
        raise SpecserveError(
            f"the shipped demo checkpoint {path} is missing; train it with `specserve train` or pass --model DIR"
        )
    return path
