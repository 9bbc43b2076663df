"""Build a TargetEngine from a checkpoint folder: the one place `generate`, `serve` and the target
service turn flags into a running engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import SpecserveError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: Path
    device: str = "cpu"
    dtype: str = "float32"
    num_kv_blocks: int = 4096
    kv_block_size: int = 16
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecserveError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not Path(self.model).is_dir():
            raise SpecserveError(f"model folder {self.model} does not exist")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecserveError("--device cuda was asked for but no CUDA GPU is visible")


def build_engine(cfg: EngineConfig):
    """Load the checkpoint and wrap it in a TargetEngine with its paged KV cache."""
    from specserve.target_service.engine.engine import TargetEngine
    from specserve.target_service.models.loader import load_model, load_tokenizer

    model, model_config = load_model(cfg.model, device=cfg.device, dtype=DTYPES[cfg.dtype])
    tokenizer = load_tokenizer(cfg.model)
    return TargetEngine(
        model,
        model_config,
        tokenizer,
        num_blocks=cfg.num_kv_blocks,
        block_size=cfg.kv_block_size,
        device=cfg.device,
    )
