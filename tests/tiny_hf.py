"""One way to write a tiny random Hugging Face checkpoint for tests: transformers' own model class,
random weights from a fixed seed, float32, written with save_pretrained (the oracle our loader and
models are compared against)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_hf(model_type: str, kwargs: dict, out: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Build transformers' model for ``model_type`` from ``kwargs`` with seed ``seed`` and save it to ``out``.

    DeepSeek-V3's e_score_correction_bias buffer starts at zero in transformers; it gets small random
    values here so that the routing bias is exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out
