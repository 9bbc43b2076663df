"""Read a drafter's safetensors file, and named tensors (token embeddings, output head) from the target's
checkpoint for drafters that share them with the target instead of storing their own copies (EAGLE-3
heads, shared-head DFlash). A short or corrupt file is a DrafterConfigError naming it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.draft_service.drafter_errors import DrafterConfigError


def read_tensors(file: str | Path, who: str, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """{name: tensor} of a safetensors file: all of them, or those of ``names`` it holds.

    A short, corrupt or unreadable file raises DrafterConfigError naming ``who`` and the file."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = list(f.keys()) if names is None else [n for n in names if n in set(f.keys())]
            return {name: f.get_tensor(name) for name in keys}
    except Exception as e:  # safetensors raises its own error types for bad headers / short files
        raise DrafterConfigError(f"{who}: corrupt or unreadable safetensors file {file}: {e}") from e


def read_target_tensors(target_dir: str | Path, names: Mapping[str, str], who: str) -> dict[str, torch.Tensor]:
    """{our name: tensor} for each ``names`` entry (our name -> the target checkpoint's tensor name).

    A missing or unreadable target, or a tensor it lacks, raises DrafterConfigError naming ``who``; so does a demo@
    target (models/model_names.py), whose tensors exist only in the model built at load time: the drafters that read
    them are built from the demo's and scaled to it (models/scaled_drafters.py)."""
    from specserve.draft_service.checkpoint_checks import target_name
    from specserve.models.loader import checkpoint_files

    if target_name(target_dir).scaled:
        raise DrafterConfigError(
            f"{who} reads tensors from a checkpoint; {target_dir} is built at load time (its "
            "drafters are the demo's, scaled to it: models/scaled_drafters.py)"
        )
    try:
        files = checkpoint_files(str(target_dir))
    except Exception as e:
        raise DrafterConfigError(f"{who} reads tensors from the target checkpoint {target_dir}: {e}") from e
    found: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = read_tensors(file, f"{who} (target checkpoint)", [t for o, t in names.items() if o not in found])
        found.update({ours: tensors[theirs] for ours, theirs in names.items() if theirs in tensors})
    missing = [theirs for ours, theirs in names.items() if ours not in found]
    if missing:
        raise DrafterConfigError(f"target checkpoint {target_dir} lacks {', '.join(missing)} ({who})")
    return found
