"""What a drafter is (DrafterInfo, for the gateway's compatibility check) and how to build one (DrafterConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.contract.speculation import DEFAULT_MAX_BLOCK_SIZE
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.models.dtypes import DTYPES


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DrafterConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter is, for the gateway's compatibility check and the DraftInfo RPC."""

    family: str
    vocab_size: int  # 0 = vocabulary-agnostic (ngram without a target checkpoint)
    vocab_hash: str  # "" = vocabulary-agnostic; else must equal TargetEngine.info().vocab_hash
    max_block_size: int
    needs_hidden_states: bool
    hidden_layers: tuple[int, ...]  # target layers whose hidden states it consumes (prefill/verify arg)
    has_probs: bool  # DraftBlock.probs is filled for sampled requests (greedy: always None = one-hot)
    supports_tree: bool

    def __post_init__(self) -> None:
        if self.max_block_size < 1:
            raise ValueError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if self.needs_hidden_states and not self.hidden_layers:
            raise ValueError("a drafter that needs hidden states must name its hidden_layers")


@dataclass(frozen=True)
class DrafterConfig:
    """How to build one drafter. ``family`` picks the factory in ``registry.py``."""

    family: str
    checkpoint: Path | None = None  # the drafter's own checkpoint dir (model / eagle3 / dflash)
    # the target: its checkpoint dir (vocab check, eagle3 embeddings, layers) or a model name; a demo@ name
    # (models/model_names.py) has eagle3 / model / dflash / mtp build the demo-size checkpoint scaled to it
    target_checkpoint: Path | None = None
    device: str = "cpu"
    dtype: torch.dtype | str = torch.float32
    max_block_size: int = DEFAULT_MAX_BLOCK_SIZE  # the most tokens one proposal drafts (contract/speculation.py)
    # ngram options
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    # model drafter: paged KV cache size
    kv_block_size: int = 16
    kv_num_blocks: int = 512
    # eagle3 / dflash: override the target layers to read (default: the checkpoint's or the family's)
    hidden_layers: tuple[int, ...] | None = None
    # dflash: passes per drafted block (default: the checkpoint's denoise_steps)
    denoise_steps: int | None = None
    # on CUDA, drafts as CUDA graphs over a window of this many positions (0 = eager only): eagle3 chains
    # (eagle3_graph.py), model chains (model_graph.py), dflash blocks (dflash_graph.py); longer contexts draft eagerly
    graph_window: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise DrafterConfigError(f"family must be a non-empty string, got {self.family!r}")
        for name in ("checkpoint", "target_checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.max_block_size < 1:
            raise DrafterConfigError(f"max_block_size must be >= 1, got {self.max_block_size}")
        if self.graph_window < 0:
            raise DrafterConfigError(f"graph_window must be >= 0, got {self.graph_window}")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise DrafterConfigError(
                f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}"
            )
        if self.kv_block_size < 1 or self.kv_num_blocks < 1:
            raise DrafterConfigError("kv_block_size and kv_num_blocks must be >= 1")
        if self.denoise_steps is not None and self.denoise_steps < 1:
            raise DrafterConfigError(f"denoise_steps must be >= 1, got {self.denoise_steps}")
        if self.hidden_layers is not None:
            object.__setattr__(self, "hidden_layers", tuple(int(i) for i in self.hidden_layers))
            if not self.hidden_layers:
                raise DrafterConfigError("hidden_layers, when given, must name at least one layer")
