"""Paged attention through the Triton kernels of any head size (specserve.kernels.paged_attention): the model side.

FlashInfer serves GQA head dims 64/128/256 and MLA (512, 64). Every other size (the shipped demo's MLA latent 64 /
rope 16, the tiny presets) runs here on CUDA: one kernel launch per layer (two with split-kv), against the dozens
of small torch ops of the graph-safe torch path (paged_torch_attention.py), which stays the fallback.

A step's metadata is a `RowsStep`: the kernels' `PagedRows` as views into ONE int32 device buffer (block tables,
kv lengths, new-token starts, row -> request, row -> index) plus a bool tree mask, and a pinned host copy of
each. `fill` writes the host copies with numpy (no torch ops per request) and issues one asynchronous copy per
buffer, so refilling a captured graph's step costs a few microseconds and never synchronises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.kernels.paged_attention import fixed_splits, num_splits_for, paged_gqa_attention, paged_mla_attention
from specserve.kernels.paged_rows import PagedRows, tree_paths_of
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import MLAConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.paged_backend import PagedBackend

# the most rows a step of invariant steps carries (the target pads them to graph_max_draft + 1, 64 on the CPU): a
# longer step (a prefill) is no invariant step and keeps the usual split-kv count (fixed splits at thousands of rows
# would need a workspace of rows x heads x 64 splits)
INVARIANT_MAX_ROWS = 64


class TritonPagedError(ValueError):
    """A step that does not fit the static shape it was prepared into, or a backend used out of order."""


@dataclass(frozen=True)
class RowsShape:
    """The fixed sizes of one step's metadata."""

    num_requests: int  # B
    num_rows: int  # N new tokens over the batch
    max_blocks: int  # block-table entries per request
    max_new: int | None  # tree-mask columns; None = causal (no mask)
    num_splits: int  # split-kv chunks per row (1 = one launch per layer)
    split_chunk: int = 0  # > 0: per-row split ranges over what each row sees, in multiples of it (invariant steps)
    paths: bool = False  # trees as rows' paths (PagedRows.tree_paths: invariant steps), not as a mask


class RowsStep:
    """Device metadata of one step shape (PagedRows views of one int32 buffer) and its pinned host staging."""

    def __init__(self, shape: RowsShape, device: torch.device, heads: int, width: int) -> None:
        b, n, nb = shape.num_requests, shape.num_rows, shape.max_blocks
        self.shape = shape
        self._sizes = (b * nb, b, b, n, n)  # block tables, kv lens, new starts, row request, row index
        pinned = device.type == "cuda"
        self._ints = torch.zeros(sum(self._sizes), dtype=torch.int32, device=device)
        self._ints_host = torch.zeros(sum(self._sizes), dtype=torch.int32, pin_memory=pinned)
        self._mask = self._mask_host = None
        if shape.max_new is not None:  # the tree mask [N, max_new] bool, or the rows' paths [N, max_new] int32
            kind = torch.int32 if shape.paths else torch.bool
            self._mask = torch.zeros(n, shape.max_new, dtype=kind, device=device)
            self._mask_host = torch.zeros(n, shape.max_new, dtype=kind, pin_memory=pinned)
        tables, kv_lens, starts, row_req, row_idx = self._ints.split(self._sizes)
        tree, paths = (None, self._mask) if shape.paths else (self._mask, None)
        self.rows = PagedRows(tables.view(b, nb), kv_lens, starts, row_req, row_idx, tree, paths)
        view = self._ints_host.numpy()  # numpy views of the pinned staging, one per field
        offsets = np.cumsum((0,) + self._sizes)
        self._h = [view[offsets[i] : offsets[i + 1]] for i in range(5)]
        self._h[0] = self._h[0].reshape(b, nb)
        self._h_mask = None if self._mask_host is None else self._mask_host.numpy()
        # paths of a chain (row i: new tokens 0..i, then zeros): the tree_paths form of a causal request, built once
        q = shape.max_new or 1
        self._chain_paths = np.tril(np.tile(np.arange(q, dtype=np.int32), (q, 1)))
        # split-kv partial results: [N * heads * splits * (width + 2)] fp32, allocated once per step shape
        self.workspace = None
        if shape.num_splits > 1:
            self.workspace = torch.empty(n * heads * shape.num_splits * (width + 2), dtype=torch.float32, device=device)
        # the last copies out of the staging buffers: refilling them first waits for it (never in practice: a step
        # ends with a device-to-host read of its results, long after its metadata copies ran)
        self._copied = torch.cuda.Event() if pinned else None

    def fill(self, attn: AttentionBatch, block_size: int) -> None:
        """Write attn's metadata into the host staging, then copy it to the device buffers (asynchronously)."""
        s = self.shape
        if (
            attn.num_seqs > s.num_requests
            or attn.num_rows > s.num_rows
            or max(attn.query_lens) > (s.max_new or 1 << 30)
        ):
            raise TritonPagedError(f"step {attn.query_lens} does not fit the step shape {s}")
        if s.max_new is None and any(m is not None for m in attn.tree_masks):
            raise TritonPagedError("a tree step in a causal (mask-free) step shape")
        if self._copied is not None:
            self._copied.synchronize()
        tables, kv_lens, starts, row_req, row_idx = self._h
        kv_lens[:] = 0
        starts[:] = 0
        row_req[:] = -1
        row_idx[:] = 0
        mask = self._h_mask
        if mask is not None:
            mask[:] = False
        for b, ((first, end), ctx, table, tree) in enumerate(
            zip(attn.token_ranges(), attn.context_lens, attn.block_tables, attn.tree_masks)
        ):
            q = end - first
            need = -(-(ctx + q) // block_size)
            if need > s.max_blocks:
                raise TritonPagedError(f"request {b} needs {need} blocks, the step holds {s.max_blocks}")
            tables[b, :need] = table[:need]
            kv_lens[b] = ctx + q
            starts[b] = ctx
            row_req[first:end] = b
            row_idx[first:end] = np.arange(q)
            if mask is not None:
                if s.paths and tree is None:  # a chain's paths: row i reads new tokens 0..i, its depth is i
                    mask[first:end, :q] = self._chain_paths[:q, :q]
                elif s.paths:  # each row's path in depth order, row_idx its depth
                    paths, depth = tree_paths_of(tree.cpu())
                    mask[first:end, :q], row_idx[first:end] = paths.numpy(), depth.numpy()
                else:
                    mask[first:end, :q] = np.tri(q, dtype=bool) if tree is None else tree.cpu().numpy()
        # pad rows (AttentionBatch.pad_rows) keep row_request -1: the kernels give such a row no keys and output 0
        self._ints.copy_(self._ints_host, non_blocking=True)
        if mask is not None:
            self._mask.copy_(self._mask_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class TritonPagedBackend(PagedBackend):
    """The model's Triton paged attention: `prepare` per step, then every layer's `gqa` / `mla`.

    `gqa_cached` / `mla_cached` attend over a cache this step's entries were already written to (by the fused
    RoPE + cache-write kernel); `gqa` / `mla` write them first."""

    error = TritonPagedError
    what = "Triton paged attention"

    def __init__(
        self,
        attn_module: torch.nn.Module,
        block_size: int,
        device: torch.device | str,
        invariant: bool = False,
        max_window: int = 0,
    ) -> None:
        super().__init__(block_size)
        # invariant steps: one split count for every step (from max_window) and per-row split ranges sized from what
        # each row sees, so a row's tiles and the order they are merged in depend on neither the step's rows nor its
        # request's kv length, and a short context still spreads over many programs
        self._fixed_splits = fixed_splits(max_window) if invariant else None
        cfg = attn_module.cfg
        self.scale = float(attn_module.scale)
        self.mla_dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim) if isinstance(cfg, MLAConfig) else None
        self.num_heads = attn_module.num_heads
        self.num_kv_heads = 1 if self.mla_dims else attn_module.num_kv_heads
        self.width = cfg.kv_lora_rank if self.mla_dims else cfg.head_dim  # the output row width per head
        self.device = torch.device(device)
        # the longest window a graph step was made for: eager steps within it use the same split-kv count, so an
        # eager step computes bit for bit what the graph of its shape computes
        self._split_window = 0

    def _new_step(self, num_requests: int, num_rows: int, max_kv: int, max_new: int | None) -> RowsStep:
        programs = num_rows * self.num_kv_heads
        fixed = self._fixed_splits if num_rows <= INVARIANT_MAX_ROWS else None  # prefills: the usual split count
        splits, chunk = fixed or (num_splits_for(max(max_kv, self._split_window), programs), 0)
        shape = RowsShape(
            num_requests, num_rows, -(-max_kv // self.block_size), max_new, splits, chunk, paths=fixed is not None
        )
        return RowsStep(shape, self.device, self.num_heads, self.width)

    def new_graph_step(self, shape) -> RowsStep:
        """The buffers of a CUDA-graph step (shape: kernels.attention.GraphShape)."""
        max_new = max(shape.query_lens) if shape.tree else None
        self._split_window = max(self._split_window, shape.max_kv_len)
        return self._new_step(len(shape.query_lens), sum(shape.query_lens), shape.max_kv_len, max_new)

    def _plan(self, attn: AttentionBatch, step: RowsStep | None) -> RowsStep:
        """Fill this step's buffers (a new eager step's, or a graph runner's)."""
        if step is None:
            kv = max(c + q for c, q in zip(attn.context_lens, attn.query_lens))
            tree = any(m is not None for m in attn.tree_masks)
            step = self._new_step(attn.num_seqs, attn.num_rows, kv, max(attn.query_lens) if tree else None)
        step.fill(attn, self.block_size)
        return step

    def bind(self, attn: AttentionBatch, step: RowsStep) -> None:
        """Serve `attn` from `step`'s buffers as they are, without filling them: for a CUDA graph that sets the lengths
        and block table on the device itself (draft_service/model_graph.py); forward's prepare is then a no-op."""
        self._step, self._prepared_for = step, attn

    def gqa_cached(self, layer: int, q: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """q [T, Hq, D] over a cache that already holds this step's K/V -> [T, Hq, D]."""
        step = self._planned(attn)
        return paged_gqa_attention(
            q,
            kv_cache.layers[layer],
            step.rows,
            self.scale,
            num_splits=step.shape.num_splits,
            workspace=step.workspace,
            split_chunk=step.shape.split_chunk,
        )

    def mla_cached(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed MLA over a cache that already holds this step's entries -> [T, H, R]."""
        step = self._planned(attn)
        return paged_mla_attention(
            q_nope,
            q_pe,
            kv_cache.layers[layer],
            step.rows,
            self.scale,
            num_splits=step.shape.num_splits,
            workspace=step.workspace,
            split_chunk=step.shape.split_chunk,
        )
