"""Attention backend selection and the FlashInfer fast path (plan once per step, run once per layer).

`select_attention_backend` is the one place that decides between the plain-torch attention in models/attention.py
and FlashInfer. The FlashInfer path works in three parts:

- `StepAttention`: the FlashInfer wrappers for one step shape, planned from host metadata (CPU int32 tensors; no
  device-to-host reads). With `graph=GraphShape(...)` its wrappers run in FlashInfer's CUDA-graph mode over fixed
  index buffers, so a graph captured over `run` stays valid after a later `plan` with new lengths and blocks.
  Decode (every request one new token, no tree): BatchDecode (tensor cores); chains and prefill: BatchPrefill,
  causal; trees: BatchPrefill with a custom mask, packed here on the host. MLA: BatchMLAPagedAttention, causal on
  the cache's blocks; a tree runs each new token as its own request over the token-granular view of the cache
  (as specserve.kernels.attention.MLAPagedAttention does).
- `FlashInferBackend`: owned by the model (`CausalLM.set_attention_backend`); `prepare(attn)` plans a step (eager:
  its own StepAttention; a graph runner passes the graph's), then each attention layer calls `gqa` / `mla`, which
  write this step's cache entries (no checks, no host syncs) and run the planned wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.kernels.attention import FLASHINFER_IMPORT_ERROR, HAS_FLASHINFER, _token_page_plan
from specserve.kernels.paged_batch import PagedBatch
from specserve.target_service.engine.attn_metadata import AttentionBatch
from specserve.target_service.engine.kv_cache import PagedKVCache
from specserve.target_service.models.config import GQAConfig, MLAConfig, ModelConfig

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
GQA_HEAD_DIMS = (64, 128, 256)  # FlashInfer fa2 head dims
MLA_DIMS = ((512, 64),)  # (kv_lora_rank, rope dim) FlashInfer's MLA kernels support
# CUDA-graph-mode prefill plans size the split-kv temporaries for the padded grid: Qwen3-30B-A3B's 32 q heads x 128
# at 17 tokens needed 132 MB on the H200 (128 MB overflowed), so one shared 512 MB float workspace.
WORKSPACE_BYTES = 512 << 20


class AttentionBackendError(ValueError):
    """An attention backend was asked for where it cannot run, or used out of order."""


def flashinfer_unsupported(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> str:
    """Why FlashInfer cannot run this model here ('' when it can)."""
    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    if not HAS_FLASHINFER:
        return f"flashinfer is not importable ({FLASHINFER_IMPORT_ERROR or 'not installed'})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (FlashInfer needs bf16 or fp16)"
    att = config.attention
    if isinstance(att, GQAConfig):
        if att.head_dim not in GQA_HEAD_DIMS:
            return f"head_dim {att.head_dim} not in {GQA_HEAD_DIMS}"
        if att.sliding_window is not None:
            return "sliding-window attention (tree positions differ from cache order)"
        return ""
    if isinstance(att, MLAConfig):
        if (att.kv_lora_rank, att.qk_rope_head_dim) not in MLA_DIMS:
            return f"MLA dims (kv_lora_rank, rope) = {(att.kv_lora_rank, att.qk_rope_head_dim)} not in {MLA_DIMS}"
        return ""
    return f"attention kind {type(att).__name__}"


def select_attention_backend(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                             requested: str = "auto") -> str:
    """'torch' or 'flashinfer'. 'auto' takes FlashInfer where it can run; asking for it where it cannot is an error."""
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    why = flashinfer_unsupported(config, device, dtype)
    if requested == "flashinfer" and why:
        raise AttentionBackendError(f"FlashInfer attention cannot run here: {why}")
    return "torch" if why else "flashinfer"


@dataclass(frozen=True)
class AttnDims:
    """Per-rank attention sizes the wrappers are planned with."""

    mla: bool
    num_heads: int
    num_kv_heads: int  # GQA only (MLA: 1 latent head)
    head_dim: int  # GQA head dim; MLA kv_lora_rank
    rope_dim: int  # MLA only
    sm_scale: float
    dtype: torch.dtype

    @staticmethod
    def of(attn_module: torch.nn.Module, dtype: torch.dtype) -> AttnDims:
        cfg = attn_module.cfg
        if isinstance(cfg, MLAConfig):
            return AttnDims(True, attn_module.num_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                            float(attn_module.scale), dtype)
        return AttnDims(False, attn_module.num_heads, attn_module.num_kv_heads, cfg.head_dim, 0,
                        float(attn_module.scale), dtype)


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape a CUDA-graph StepAttention serves: new tokens per request, tree or not, max kv length."""

    query_lens: tuple[int, ...]
    tree: bool
    max_kv_len: int  # per request: cached + new tokens

    def __post_init__(self) -> None:
        if not self.query_lens or min(self.query_lens) < 1:
            raise AttentionBackendError(f"graph shape needs >= 1 request of >= 1 token, got {self.query_lens}")
        if self.max_kv_len < max(self.query_lens):
            raise AttentionBackendError(f"max_kv_len {self.max_kv_len} < a request's new tokens {self.query_lens}")

    @property
    def decode(self) -> bool:
        return not self.tree and all(q == 1 for q in self.query_lens)

    def matches(self, batch: PagedBatch) -> bool:
        return (batch.query_lens == self.query_lens and batch.has_tree == self.tree
                and int(batch.kv_lens.max()) <= self.max_kv_len)


def pack_tree_mask(batch: PagedBatch) -> torch.Tensor:  # [bytes] uint8, CPU
    """Every request's [q, kv_len] mask packed little-endian, request b starting at byte offset = its BIT offset.

    FlashInfer (given a packed mask) indexes request b's bits from byte mask_indptr[b], with mask_indptr the bit
    offsets sum(q * kv_len) of the requests before b; laying segments out at those byte offsets makes that exact.
    """
    offsets = [0]
    for b in range(batch.num_requests):
        offsets.append(offsets[-1] + batch.query_lens[b] * int(batch.kv_lens[b]))
    last_bits = offsets[-1] - offsets[-2]
    out = np.zeros(offsets[-2] + (last_bits + 7) // 8, dtype=np.uint8)
    for b in range(batch.num_requests):
        bits = batch.request_mask(b).reshape(-1).numpy()
        packed = np.packbits(bits, bitorder="little")
        out[offsets[b]: offsets[b] + packed.size] = packed
    return torch.from_numpy(out)


def _i32(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


class StepAttention:
    """FlashInfer wrappers for one step (eager: any shape; graph: the one GraphShape), planned per step."""

    def __init__(self, dims: AttnDims, block_size: int, device: torch.device, workspace: torch.Tensor,
                 graph: GraphShape | None = None) -> None:
        import flashinfer

        self.dims, self.block_size, self.device, self.graph = dims, block_size, device, graph
        self._fi = flashinfer
        self._workspace = workspace
        self._batch: PagedBatch | None = None
        self._token_pages = False
        self._wrappers: dict[str, object] = {}
        if graph is not None:
            self._wrappers[self._kind_of(graph.decode, graph.tree)] = self._new_graph_wrapper(graph)

    def _kind_of(self, decode: bool, tree: bool) -> str:
        if self.dims.mla:
            return "mla_tree" if tree else "mla"
        return "decode" if decode else ("tree" if tree else "prefill")

    def _new_graph_wrapper(self, g: GraphShape):
        fi, dev, b = self._fi, self.device, len(g.query_lens)
        pages = b * (-(-g.max_kv_len // self.block_size))
        if self.dims.mla:
            reqs = sum(g.query_lens) if g.tree else b  # a tree: one request per new token
            nnz = reqs * g.max_kv_len if g.tree else pages
            return fi.mla.BatchMLAPagedAttentionWrapper(
                self._workspace, use_cuda_graph=True, qo_indptr=_i32(reqs + 1, dev), kv_indptr=_i32(reqs + 1, dev),
                kv_indices=_i32(nnz, dev), kv_len_arr=_i32(reqs, dev), backend="auto")
        if g.decode:
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=_i32(b + 1, dev), paged_kv_indices_buffer=_i32(pages, dev),
                paged_kv_last_page_len_buffer=_i32(b, dev))
        mask_bytes = sum(g.query_lens) * g.max_kv_len + 16 if g.tree else None
        return fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=_i32(b + 1, dev),
            paged_kv_indptr_buf=_i32(b + 1, dev), paged_kv_indices_buf=_i32(pages, dev),
            paged_kv_last_page_len_buf=_i32(b, dev),
            custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8, device=dev) if g.tree else None,
            mask_indptr_buf=_i32(b + 1, dev) if g.tree else None, backend="fa2")

    def _eager_wrapper(self, kind: str):
        w = self._wrappers.get(kind)
        if w is None:
            fi = self._fi
            if kind.startswith("mla"):
                w = fi.mla.BatchMLAPagedAttentionWrapper(self._workspace, backend="auto")
            elif kind == "decode":
                w = fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
            self._wrappers[kind] = w
        return w

    def plan(self, batch: PagedBatch) -> None:
        """Host-side planning for this step (plus small host-to-device copies); call before run / replay."""
        d = self.dims
        if self.graph is not None and not self.graph.matches(batch):
            raise AttentionBackendError(
                f"step {batch.query_lens} (tree {batch.has_tree}, kv {batch.kv_lens.tolist()}) does not fit the "
                f"graph shape {self.graph}")
        kind = self._kind_of(batch.is_decode and not batch.has_tree, batch.has_tree)
        w = self._wrappers[kind] if self.graph is not None else self._eager_wrapper(kind)
        if d.mla:
            self._token_pages = batch.has_tree
            if self._token_pages:
                qo, kv_indptr, kv_indices, kv_lens = _token_page_plan(batch)
                page = 1
            else:
                qo, kv_indptr, kv_indices, kv_lens = batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens
                page = batch.block_size
            w.plan(qo, kv_indptr, kv_indices, kv_lens, d.num_heads, d.head_dim, d.rope_dim, page,
                   not self._token_pages, d.sm_scale, d.dtype, d.dtype)
        elif kind == "decode":
            w.plan(batch.kv_indptr, batch.kv_indices, batch.last_page_lens(), d.num_heads, d.num_kv_heads,
                   d.head_dim, batch.block_size, q_data_type=d.dtype, kv_data_type=d.dtype, sm_scale=d.sm_scale)
        else:
            packed = pack_tree_mask(batch) if batch.has_tree else None
            w.plan(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.last_page_lens(), d.num_heads,
                   d.num_kv_heads, d.head_dim, batch.block_size, packed_custom_mask=packed, causal=packed is None,
                   sm_scale=d.sm_scale, q_data_type=d.dtype, kv_data_type=d.dtype)
        self._active = w
        self._batch = batch

    def run_gqa(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], cache [num_blocks, block_size, 2, Hkv, D] -> [T, Hq, D]."""
        return self._active.run(q, (cache[:, :, 0], cache[:, :, 1]))

    def run_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, R] (absorbed), q_pe [T, H, P], cache [num_blocks, block_size, R + P] -> [T, H, R]."""
        r = self.dims.head_dim
        paged = cache.view(-1, 1, cache.shape[-1]) if self._token_pages else cache
        return self._active.run(q_nope, q_pe, paged[..., :r], paged[..., r:])


def paged_batch_of(attn: AttentionBatch, block_size: int) -> PagedBatch:
    """The kernels' CSR metadata of an AttentionBatch (host only)."""
    return PagedBatch.build(attn.query_lens, attn.context_lens, attn.block_tables, block_size, attn.tree_masks)


class FlashInferBackend:
    """The model's FlashInfer attention: plans one StepAttention per step and serves every layer from it."""

    def __init__(self, attn_module: torch.nn.Module, block_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if not HAS_FLASHINFER:
            raise AttentionBackendError(f"flashinfer is not importable ({FLASHINFER_IMPORT_ERROR or 'not installed'})")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # 'cuda' -> 'cuda:N' so device checks compare equal
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.dims = AttnDims.of(attn_module, dtype)
        self.block_size = block_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._eager = StepAttention(self.dims, block_size, self.device, self.workspace)
        self._step: StepAttention | None = None
        self._prepared_for: AttentionBatch | None = None

    def new_graph_step(self, shape: GraphShape) -> StepAttention:
        return StepAttention(self.dims, self.block_size, self.device, self.workspace, shape)

    def prepare(self, attn: AttentionBatch, step: StepAttention | None = None) -> None:
        """Plan this step (once; later calls with the same batch object are no-ops unless a step is given)."""
        if step is None and self._prepared_for is attn:
            return
        step = step or self._eager
        step.plan(paged_batch_of(attn, self.block_size))
        self._step, self._prepared_for = step, attn

    def _planned(self, attn: AttentionBatch) -> StepAttention:
        if self._step is None or self._prepared_for is not attn:
            raise AttentionBackendError("FlashInfer attention ran on a batch it was not prepared for")
        return self._step

    def gqa(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBatch,
            kv_cache: PagedKVCache) -> torch.Tensor:
        """Write k, v [T, Hkv, D] at attn.slot_mapping (every slot >= 0), then attend: q [T, Hq, D] -> [T, Hq, D]."""
        step = self._planned(attn)
        cache = kv_cache.layers[layer]  # [NB, BS, 2, Hkv, D]
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, attn.slot_mapping, torch.stack([k, v], dim=1).to(cache.dtype))
        return step.run_gqa(q.contiguous(), cache)

    def mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
            attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """Write entries [T, R + P] at attn.slot_mapping, then absorbed MLA: q_nope [T, H, R], q_pe [T, H, P] -> [T, H, R]."""
        step = self._planned(attn)
        cache = kv_cache.layers[layer]  # [NB, BS, R + P]
        cache.view(-1, cache.shape[-1]).index_copy_(0, attn.slot_mapping, entries.to(cache.dtype))
        return step.run_mla(q_nope.contiguous(), q_pe.contiguous(), cache)


class ReferencePagedBackend:
    """The fast path's plumbing (prepare per step, cache writes by slot, absorbed MLA) over the pure-torch paged
    references of specserve.kernels.attention_reference: runs anywhere, so CPU tests check that plumbing
    against the plain-torch attention of models/attention.py."""

    def __init__(self, attn_module: torch.nn.Module, block_size: int) -> None:
        self.scale = float(attn_module.scale)
        self.block_size = block_size
        self._batch: PagedBatch | None = None
        self._prepared_for: AttentionBatch | None = None

    def prepare(self, attn: AttentionBatch, step: object = None) -> None:
        if step is not None:
            raise AttentionBackendError("the reference backend has no CUDA-graph steps")
        if self._prepared_for is not attn:
            self._batch, self._prepared_for = paged_batch_of(attn, self.block_size), attn

    def _planned(self, attn: AttentionBatch) -> PagedBatch:
        if self._batch is None or self._prepared_for is not attn:
            raise AttentionBackendError("reference attention ran on a batch it was not prepared for")
        return self._batch

    def gqa(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: AttentionBatch,
            kv_cache: PagedKVCache) -> torch.Tensor:
        from specserve.kernels.attention_reference import paged_attention_reference

        batch = self._planned(attn)
        cache = kv_cache.layers[layer]
        cache.view(-1, *cache.shape[2:]).index_copy_(0, attn.slot_mapping, torch.stack([k, v], dim=1).to(cache.dtype))
        return paged_attention_reference(q, cache, batch, self.scale)

    def mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, entries: torch.Tensor,
            attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        from specserve.kernels.attention_reference import mla_attention_reference

        batch = self._planned(attn)
        cache = kv_cache.layers[layer]
        cache.view(-1, cache.shape[-1]).index_copy_(0, attn.slot_mapping, entries.to(cache.dtype))
        return mla_attention_reference(q_nope, q_pe, cache, batch, self.scale)


def make_attention_backend(model: torch.nn.Module, kind: str, block_size: int, device: torch.device | str,
                           dtype: torch.dtype):
    """The backend object for a kind from select_attention_backend ('torch' -> None) or 'reference'."""
    attn_module = model.model.layers[0].self_attn
    if kind == "torch":
        return None
    if kind == "flashinfer":
        return FlashInferBackend(attn_module, block_size, device, dtype)
    if kind == "reference":
        return ReferencePagedBackend(attn_module, block_size)
    raise AttentionBackendError(f"unknown attention backend kind {kind!r}")
