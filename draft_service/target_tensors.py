"""Read named tensors (token embeddings, output head) from the target's checkpoint, for drafters that
share them with the target instead of storing their own copies (EAGLE-3 heads, shared-head DFlash)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.draft_service.proposer import DrafterConfigError


def read_target_tensors(target_dir: str | Path, names: Mapping[str, str], who: str) -> dict[str, torch.Tensor]:
    """{our name: tensor} for each ``names`` entry (our name -> the target checkpoint's tensor name).

    A missing or unreadable target, or a tensor it lacks, raises DrafterConfigError naming ``who``."""
    from specserve.models.loader import checkpoint_files

    try:
        files = checkpoint_files(str(target_dir))
    except Exception as e:
        raise DrafterConfigError(f"{who} reads tensors from the target checkpoint {target_dir}: {e}") from e
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            keys = set(f.keys())
            for ours, theirs in names.items():
                if theirs in keys:
                    found[ours] = f.get_tensor(theirs)
    missing = [theirs for ours, theirs in names.items() if ours not in found]
    if missing:
        raise DrafterConfigError(f"target checkpoint {target_dir} lacks {', '.join(missing)} ({who})")
    return found
