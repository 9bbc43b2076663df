"""FlashInfer paged attention wrappers (optional dependency): GQA decode, GQA verify/prefill with a tree mask, MLA.

Each wrapper is plan-then-run: plan(batch) once per step (host work, not CUDA-graph capturable), then run() once
per layer. Same results as the references in attention_reference.py (same arguments, minus plan state).

Layouts (one layer):
  GQA cache [num_blocks, block_size, 2, n_kv_heads, head_dim]  (K and V interleaved on dim 2; passed to FlashInfer
            as two strided NHD views, no copy)
  MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim]   (latent then rope key; two strided views)
Without flashinfer (CPU installs, CI) this module imports fine; HAS_FLASHINFER is False and constructing a
wrapper raises KernelArgumentError.
"""

from __future__ import annotations

import torch

from specserve.kernels.checks import KernelArgumentError, check_dim, check_tensor, require
from specserve.kernels.paged_batch import PagedBatch

try:
    import flashinfer

    HAS_FLASHINFER = True
    FLASHINFER_IMPORT_ERROR = ""
except Exception as exc:  # ImportError, or a broken install: report why, never crash at import
    HAS_FLASHINFER = False
    FLASHINFER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

DEFAULT_WORKSPACE_BYTES = 128 << 20
_DTYPES = (torch.bfloat16, torch.float16)


def _require_flashinfer() -> None:
    require(HAS_FLASHINFER, f"flashinfer is not importable here ({FLASHINFER_IMPORT_ERROR or 'not installed'})")


def _cuda_device(device: torch.device | str) -> torch.device:
    """Normalize 'cuda' to 'cuda:<current>' so device equality checks match tensors' devices."""
    dev = torch.device(device)
    require(dev.type == "cuda", f"FlashInfer needs a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _workspace(device: torch.device, workspace: torch.Tensor | None) -> torch.Tensor:
    if workspace is None:
        return torch.zeros(DEFAULT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    check_tensor("workspace", workspace, 1, (torch.uint8,))
    require(workspace.device == device, f"workspace is on {workspace.device}, wrapper device is {device}")
    return workspace


def check_gqa_cache(kv_cache: torch.Tensor, batch: PagedBatch, n_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> None:
    """kv_cache must be [num_blocks, block_size, 2, n_kv_heads, head_dim], contiguous, planned dtype."""
    check_tensor("kv_cache", kv_cache, 5, (dtype,))
    check_dim("kv_cache", kv_cache, 1, batch.block_size, "the planned block_size")
    check_dim("kv_cache", kv_cache, 2, 2, "2 (K then V)")
    check_dim("kv_cache", kv_cache, 3, n_kv_heads, "n_kv_heads")
    check_dim("kv_cache", kv_cache, 4, head_dim, "head_dim")
    batch.check_blocks_fit(kv_cache.shape[0], "kv_cache")


def check_query(name: str, q: torch.Tensor, rows: int, heads: int, dim: int, dtype: torch.dtype,
                device: torch.device) -> None:
    """q must be [rows, heads, dim] of the planned dtype on the wrapper's device (last dim contiguous)."""
    check_tensor(name, q, 3, (dtype,), contiguous=False)
    require(q.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {q.stride()}")
    check_dim(name, q, 0, rows, "the planned number of new tokens")
    check_dim(name, q, 1, heads, "the number of query heads")
    check_dim(name, q, 2, dim, "the head dim")
    require(q.device == device, f"{name} is on {q.device}, wrapper device is {device}")


class _GQABase:
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, workspace: torch.Tensor | None) -> None:
        _require_flashinfer()
        require(num_kv_heads >= 1 and num_qo_heads % num_kv_heads == 0,
                f"num_qo_heads ({num_qo_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        require(dtype in _DTYPES, f"dtype must be bf16 or fp16, got {dtype}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.dtype = num_qo_heads, num_kv_heads, head_dim, dtype
        self.device = _cuda_device(device)
        self._workspace = _workspace(self.device, workspace)
        self._batch: PagedBatch | None = None

    def _planned(self) -> PagedBatch:
        if self._batch is None:
            raise KernelArgumentError(f"{type(self).__name__}.run() called before plan()")
        return self._batch

    def _check_run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> PagedBatch:
        batch = self._planned()
        check_query("q", q, batch.num_tokens, self.num_qo_heads, self.head_dim, self.dtype, self.device)
        check_gqa_cache(kv_cache, batch, self.num_kv_heads, self.head_dim, self.dtype)
        require(kv_cache.device == self.device, f"kv_cache is on {kv_cache.device}, wrapper device is {self.device}")
        return batch


class PagedDecodeAttention(_GQABase):
    """One new token per request (plain decode). FlashInfer BatchDecode with tensor cores (GQA groups)."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, workspace: torch.Tensor | None = None) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, dtype, device, workspace)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)

    def plan(self, batch: PagedBatch, sm_scale: float | None = None) -> None:
        require(batch.is_decode, f"PagedDecodeAttention needs one new token per request, got {batch.query_lens}")
        dev = self.device
        self._wrapper.plan(
            batch.kv_indptr.to(dev), batch.kv_indices.to(dev), batch.last_page_lens().to(dev), self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim, batch.block_size, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=sm_scale,
        )
        self._batch = batch

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:  # q [B, Hq, D] -> [B, Hq, D]
        self._check_run(q, kv_cache)
        return self._wrapper.run(q, (kv_cache[:, :, 0], kv_cache[:, :, 1]))


class PagedVerifyAttention(_GQABase):
    """Several new tokens per request (verify a draft chain/tree, or prefill). Causal, or the batch's tree masks."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, workspace: torch.Tensor | None = None) -> None:
        super().__init__(num_qo_heads, num_kv_heads, head_dim, dtype, device, workspace)
        # fa2 for both masks: one JIT module (the same one PagedDecodeAttention uses).
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")

    def plan(self, batch: PagedBatch, sm_scale: float | None = None) -> None:
        mask = None
        if batch.has_tree:
            mask = torch.cat([batch.request_mask(b).reshape(-1) for b in range(batch.num_requests)])
            mask = mask.to(self.device)
        dev = self.device  # all on the device: FlashInfer packs the custom mask with a CUDA kernel
        self._wrapper.plan(
            batch.qo_indptr.to(dev), batch.kv_indptr.to(dev), batch.kv_indices.to(dev),
            batch.last_page_lens().to(dev), self.num_qo_heads,
            self.num_kv_heads, self.head_dim, batch.block_size, custom_mask=mask, causal=mask is None,
            sm_scale=sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        self._batch = batch

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:  # q [Nq, Hq, D] -> [Nq, Hq, D]
        self._check_run(q, kv_cache)
        return self._wrapper.run(q, (kv_cache[:, :, 0], kv_cache[:, :, 1]))


class MLAPagedAttention:
    """MLA (absorbed form) over the paged latent cache. FlashInfer BatchMLAPagedAttentionWrapper.

    Causal batches (decode, chain verify) run on the cache's own blocks. A batch with tree masks runs each new
    token as its own one-query request over a token-granular view of the cache (page size 1), whose page list is
    its request's cached tokens plus its tree ancestors: exact for any tree, at the cost of re-reading the
    prefix once per tree node.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                 device: torch.device | str, workspace: torch.Tensor | None = None, backend: str = "auto") -> None:
        _require_flashinfer()
        require(dtype in _DTYPES, f"dtype must be bf16 or fp16, got {dtype}")
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.dtype = num_heads, kv_lora_rank, rope_dim, dtype
        self.device = _cuda_device(device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(_workspace(self.device, workspace),
                                                                     backend=backend)
        self._batch: PagedBatch | None = None
        self._token_pages = False

    def plan(self, batch: PagedBatch, sm_scale: float) -> None:
        self._token_pages = batch.has_tree
        if self._token_pages:
            qo, kv_indptr, kv_indices, kv_lens = _token_page_plan(batch)
            page_size = 1
        else:
            qo, kv_indptr, kv_indices, kv_lens = batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens
            page_size = batch.block_size
        self._wrapper.plan(
            qo.to(self.device), kv_indptr.to(self.device), kv_indices.to(self.device), kv_lens.to(self.device),
            self.num_heads, self.kv_lora_rank, self.rope_dim, page_size, not self._token_pages, sm_scale,
            self.dtype, self.dtype,
        )
        self._batch = batch

    def run(
        self,
        q_nope: torch.Tensor,  # [Nq, H, R]
        q_pe: torch.Tensor,  # [Nq, H, P]
        cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    ) -> torch.Tensor:  # [Nq, H, R]
        if self._batch is None:
            raise KernelArgumentError("MLAPagedAttention.run() called before plan()")
        batch = self._batch
        r, p = self.kv_lora_rank, self.rope_dim
        check_query("q_nope", q_nope, batch.num_tokens, self.num_heads, r, self.dtype, self.device)
        check_query("q_pe", q_pe, batch.num_tokens, self.num_heads, p, self.dtype, self.device)
        check_tensor("cache", cache, 3, (self.dtype,))
        check_dim("cache", cache, 1, batch.block_size, "the planned block_size")
        check_dim("cache", cache, 2, r + p, "kv_lora_rank + rope_dim")
        require(cache.device == self.device, f"cache is on {cache.device}, wrapper device is {self.device}")
        batch.check_blocks_fit(cache.shape[0], "cache")
        paged = cache.view(-1, 1, r + p) if self._token_pages else cache
        return self._wrapper.run(q_nope, q_pe, paged[..., :r], paged[..., r:])


def _token_page_plan(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request per new token; its pages are the flat slots it may see (cached tokens, then tree ancestors)."""
    pages: list[torch.Tensor] = []
    for b in range(batch.num_requests):
        slots = batch.token_slots(b)  # [kv_len]
        mask = batch.request_mask(b)  # [q, kv_len]
        pages.extend(slots[mask[j]] for j in range(batch.query_lens[b]))
    lens = torch.tensor([x.numel() for x in pages], dtype=torch.int32)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens, 0)
    qo = torch.arange(len(pages) + 1, dtype=torch.int32)
    return qo, indptr, torch.cat(pages).to(torch.int32), lens
