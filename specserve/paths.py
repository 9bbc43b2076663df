"""Where the shipped demo checkpoints live (the folder demo_model/ at the repository root)."""

from __future__ import annotations

import os
from pathlib import Path

from specserve.errors import SpecserveError

DEMO_ENV = "SPECSERVE_DEMO_DIR"


def demo_dir() -> Path:
    return Path(os.environ.get(DEMO_ENV, Path(__file__).resolve().parents[1] / "demo_model"))


def demo_checkpoint(part: str) -> Path:
    """A shipped checkpoint folder: part is 'target' or a drafter family ('model', 'eagle3', 'dflash', 'mtp')."""
    path = demo_dir() / part
    if not (path / "config.json").exists():
        raise SpecserveError(
            f"the shipped demo checkpoint {path} is missing; train it with `specserve train` or pass --model DIR"
        )
    return path


def shipped_drafter(family: str) -> Path | None:
    """The shipped demo's folder of a drafter family, or None when the demo ships none for it (ngram)."""
    path = demo_dir() / family
    return path if (path / "config.json").is_file() else None
