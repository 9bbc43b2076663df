"""What the model's paged attention backends share (FlashInfer, the reference, Triton paged, paged torch).

Each step is prepared once per AttentionBatch object (``prepare``: a backend's ``_plan`` fills or plans a step's
metadata, or a CUDA-graph runner's own step), every layer is then served from that step (``_planned``), and
``gqa`` / ``mla`` write this step's K/V (or MLA entries) at the batch's slots (-1: none, pad rows) before attending over the cache
(``gqa_cached`` / ``mla_cached``, each backend's own kernels).
"""

from __future__ import annotations

import torch

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache


class PagedBackend:
    """The shared plumbing; a backend sets ``error`` (its exception type) and ``what`` (its name in messages)
    and writes ``_plan``, ``gqa_cached`` and ``mla_cached``."""

    error: type[Exception] = ValueError
    what = "paged attention"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._step = None
        self._prepared_for: AttentionBatch | None = None

    def _plan(self, attn: AttentionBatch, step):
        """This step's metadata for ``attn`` (in ``step``, a graph runner's, when given); returns the step."""
        raise NotImplementedError

    def prepare(self, attn: AttentionBatch, step=None) -> None:
        """Prepare this step (once per batch object; a graph runner passes its own step)."""
        if step is None and self._prepared_for is attn:
            return
        self._step, self._prepared_for = self._plan(attn, step), attn

    def _planned(self, attn: AttentionBatch):
        if self._step is None or self._prepared_for is not attn:
            raise self.error(f"{self.what} ran on a batch it was not prepared for")
        return self._step

    def gqa(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Write k, v [T, Hkv, D] at attn.slot_mapping, then attend: q [T, Hq, D] -> [T, Hq, D]."""
        kv_cache.write_step(layer, attn.slot_mapping, torch.stack([k, v], dim=1), attn.may_skip_rows)  # [T, 2, Hkv, D]
        return self.gqa_cached(layer, q, attn, kv_cache)

    def gqa_cached(self, layer: int, q: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        raise NotImplementedError

    def mla(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        entries: torch.Tensor,
        attn: AttentionBatch,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Write entries [T, R + P] at attn.slot_mapping, then absorbed MLA: q_nope [T, H, R], q_pe [T, H, P] -> [T, H, R]."""
        kv_cache.write_step(layer, attn.slot_mapping, entries, attn.may_skip_rows)  # [T, R + P]
        return self.mla_cached(layer, q_nope, q_pe, attn, kv_cache)

    def mla_cached(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        raise NotImplementedError
