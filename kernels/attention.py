"""FlashInfer paged attention (optional dependency): the one FlashInfer integration, used by serving, tests and the
kernel benchmark alike. GQA decode, GQA verify/prefill (causal or a tree mask), MLA (absorbed form).

`StepAttention` holds the FlashInfer wrappers of one step shape and is plan-then-run: `plan(batch)` once per step
(host work from a PagedBatch's CPU metadata, not CUDA-graph capturable), then `run_gqa` / `run_mla` once per
layer. With `graph=GraphShape(...)` its wrappers run in FlashInfer's CUDA-graph mode over fixed index buffers, so
a graph captured over `run_*` stays valid after a later `plan` with new lengths and blocks.
  Decode (every request one new token, no tree): BatchDecode (tensor cores); chains and prefill: BatchPrefill,
  causal; trees: BatchPrefill with a custom mask, packed here on the host. MLA: BatchMLAPagedAttention, causal on
  the cache's blocks; a tree runs each new token as its own one-query request over a token-granular view of the
  cache (page size 1) whose pages are its request's cached tokens plus its tree ancestors: exact for any tree, at
  the cost of re-reading the prefix once per tree node.

Layouts (one layer):
  GQA cache [num_blocks, block_size, 2, n_kv_heads, head_dim]  (K and V interleaved on dim 2; passed to FlashInfer
            as two strided NHD views, no copy)
  MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim]   (latent then rope key; two strided views)
Same results as the references in attention_reference.py. Without flashinfer (CPU installs, CI) this module
imports fine; HAS_FLASHINFER is False and constructing a StepAttention raises KernelArgumentError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.checks import (
    KernelArgumentError,
    check_dim,
    check_tensor,
    require,
)
from specserve.kernels.paged_batch import PagedBatch

try:
    import flashinfer

    HAS_FLASHINFER = True
    FLASHINFER_IMPORT_ERROR = ""
except Exception as exc:  # ImportError, or a broken install: report why, never crash at import
    HAS_FLASHINFER = False
    FLASHINFER_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

GQA_HEAD_DIMS = (64, 128, 256)  # FlashInfer fa2 head dims
MLA_DIMS = ((512, 64),)  # (kv_lora_rank, rope dim) FlashInfer's MLA kernels support
# CUDA-graph-mode prefill plans size the split-kv temporaries for the padded grid: Qwen3-30B-A3B's 32 q heads x 128
# at 17 tokens needed 132 MB on the H200 (128 MB overflowed), so one shared 512 MB float workspace.
WORKSPACE_BYTES = 512 << 20
_DTYPES = (torch.bfloat16, torch.float16)


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

    def __post_init__(self) -> None:
        require(self.dtype in _DTYPES, f"dtype must be bf16 or fp16, got {self.dtype}")
        require(
            self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads == 0,
            f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads ({self.num_kv_heads})",
        )


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape a CUDA-graph StepAttention serves: new tokens per request, tree or not, max kv length."""

    query_lens: tuple[int, ...]
    tree: bool
    max_kv_len: int  # per request: cached + new tokens

    def __post_init__(self) -> None:
        if not self.query_lens or min(self.query_lens) < 1:
            raise KernelArgumentError(f"graph shape needs >= 1 request of >= 1 token, got {self.query_lens}")
        if self.max_kv_len < max(self.query_lens):
            raise KernelArgumentError(f"max_kv_len {self.max_kv_len} < a request's new tokens {self.query_lens}")

    @property
    def decode(self) -> bool:
        return not self.tree and all(q == 1 for q in self.query_lens)

    def matches(self, batch: PagedBatch) -> bool:
        return (
            batch.query_lens == self.query_lens
            and batch.has_tree == self.tree
            and int(batch.kv_lens.max()) <= self.max_kv_len
        )


def pack_tree_mask(batch: PagedBatch) -> torch.Tensor:  # [bytes] uint8, CPU
    """Every request's [q, kv_len] mask packed little-endian, request b starting at byte offset = its BIT offset.

    FlashInfer (given a packed mask) indexes request b's bits from byte mask_indptr[b], with mask_indptr the bit
    offsets sum(q * kv_len) of the requests before b; laying segments out at those byte offsets makes that exact.
    """
    offsets = [0]
    for b in range(batch.num_requests):
        offsets.append(offsets[-1] + batch.query_lens[b] * int(batch.kv_lens[b]))
    last_bits = offsets[-1] - offsets[-2]
    out = torch.zeros(offsets[-2] + (last_bits + 7) // 8, dtype=torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32)
    for b in range(batch.num_requests):
        bits = batch.request_mask(b).reshape(-1)
        pad = (-bits.numel()) % 8
        padded = torch.cat([bits, torch.zeros(pad, dtype=torch.bool)]).view(-1, 8).to(torch.int32)
        packed = (padded * weights).sum(-1).to(torch.uint8)
        out[offsets[b] : offsets[b] + packed.numel()] = packed
    return out


def _i32(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device=device)


def _cuda_device(device: torch.device | str) -> torch.device:
    """Normalize 'cuda' to 'cuda:<current>' so device equality checks match tensors' devices."""
    dev = torch.device(device)
    require(dev.type == "cuda", f"FlashInfer needs a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def new_workspace(device: torch.device | str) -> torch.Tensor:  # [WORKSPACE_BYTES] uint8
    """The float workspace the wrappers of one model share."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def check_query(
    name: str, q: torch.Tensor, rows: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """q must be [rows, heads, dim] of the planned dtype on the wrapper's device (last dim contiguous)."""
    check_tensor(name, q, 3, (dtype,), contiguous=False)
    require(q.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {q.stride()}")
    check_dim(name, q, 0, rows, "the planned number of new tokens")
    check_dim(name, q, 1, heads, "the number of query heads")
    check_dim(name, q, 2, dim, "the head dim")
    require(q.device == device, f"{name} is on {q.device}, wrapper device is {device}")


class StepAttention:
    """FlashInfer wrappers for one step (eager: any shape; graph: the one GraphShape), planned per step."""

    def __init__(
        self,
        dims: AttnDims,
        block_size: int,
        device: torch.device | str,
        workspace: torch.Tensor | None = None,
        graph: GraphShape | None = None,
    ) -> None:
        require(HAS_FLASHINFER, f"flashinfer is not importable here ({FLASHINFER_IMPORT_ERROR or 'not installed'})")
        self.dims, self.block_size, self.graph = dims, block_size, graph
        self.device = _cuda_device(device)
        if workspace is None:
            workspace = new_workspace(self.device)
        check_tensor("workspace", workspace, 1, (torch.uint8,))
        require(workspace.device == self.device, f"workspace is on {workspace.device}, device is {self.device}")
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
        dev, b = self.device, len(g.query_lens)
        pages = b * (-(-g.max_kv_len // self.block_size))
        if self.dims.mla:
            reqs = sum(g.query_lens) if g.tree else b  # a tree: one request per new token
            nnz = reqs * g.max_kv_len if g.tree else pages
            return flashinfer.mla.BatchMLAPagedAttentionWrapper(
                self._workspace,
                use_cuda_graph=True,
                qo_indptr=_i32(reqs + 1, dev),
                kv_indptr=_i32(reqs + 1, dev),
                kv_indices=_i32(nnz, dev),
                kv_len_arr=_i32(reqs, dev),
                backend="auto",
            )
        if g.decode:
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=_i32(b + 1, dev),
                paged_kv_indices_buffer=_i32(pages, dev),
                paged_kv_last_page_len_buffer=_i32(b, dev),
            )
        mask_bytes = sum(g.query_lens) * g.max_kv_len + 16 if g.tree else None
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=_i32(b + 1, dev),
            paged_kv_indptr_buf=_i32(b + 1, dev),
            paged_kv_indices_buf=_i32(pages, dev),
            paged_kv_last_page_len_buf=_i32(b, dev),
            custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8, device=dev) if g.tree else None,
            mask_indptr_buf=_i32(b + 1, dev) if g.tree else None,
            backend="fa2",
        )

    def _eager_wrapper(self, kind: str):
        w = self._wrappers.get(kind)
        if w is None:
            if kind.startswith("mla"):
                w = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace, backend="auto")
            elif kind == "decode":
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)
            else:  # fa2 for causal and masked alike: one JIT module
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
            self._wrappers[kind] = w
        return w

    def plan(self, batch: PagedBatch) -> None:
        """Host-side planning for this step (plus small host-to-device copies); call before run / replay."""
        d = self.dims
        require(
            batch.block_size == self.block_size,
            f"batch block_size {batch.block_size} != the wrappers' block_size {self.block_size}",
        )
        if self.graph is not None and not self.graph.matches(batch):
            raise KernelArgumentError(
                f"step {batch.query_lens} (tree {batch.has_tree}, kv {batch.kv_lens.tolist()}) does not fit the "
                f"graph shape {self.graph}"
            )
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
            w.plan(
                qo,
                kv_indptr,
                kv_indices,
                kv_lens,
                d.num_heads,
                d.head_dim,
                d.rope_dim,
                page,
                not self._token_pages,
                d.sm_scale,
                d.dtype,
                d.dtype,
            )
        elif kind == "decode":
            w.plan(
                batch.kv_indptr,
                batch.kv_indices,
                batch.last_page_lens(),
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                batch.block_size,
                q_data_type=d.dtype,
                kv_data_type=d.dtype,
                sm_scale=d.sm_scale,
            )
        else:
            packed = pack_tree_mask(batch) if batch.has_tree else None
            w.plan(
                batch.qo_indptr,
                batch.kv_indptr,
                batch.kv_indices,
                batch.last_page_lens(),
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                batch.block_size,
                packed_custom_mask=packed,
                causal=packed is None,
                sm_scale=d.sm_scale,
                q_data_type=d.dtype,
                kv_data_type=d.dtype,
            )
        self._active = w
        self._batch = batch

    def _planned(self) -> PagedBatch:
        if self._batch is None:
            raise KernelArgumentError("StepAttention run called before plan()")
        return self._batch

    def run_gqa(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], cache [num_blocks, block_size, 2, Hkv, D] -> [T, Hq, D]."""
        d, batch = self.dims, self._planned()
        require(not d.mla, "run_gqa on MLA dims")
        check_query("q", q, batch.num_tokens, d.num_heads, d.head_dim, d.dtype, self.device)
        check_tensor("kv_cache", cache, 5, (d.dtype,))
        check_dim("kv_cache", cache, 1, batch.block_size, "the planned block_size")
        check_dim("kv_cache", cache, 2, 2, "2 (K then V)")
        check_dim("kv_cache", cache, 3, d.num_kv_heads, "n_kv_heads")
        check_dim("kv_cache", cache, 4, d.head_dim, "head_dim")
        require(cache.device == self.device, f"kv_cache is on {cache.device}, device is {self.device}")
        batch.check_blocks_fit(cache.shape[0], "kv_cache")
        return self._active.run(q, (cache[:, :, 0], cache[:, :, 1]))

    def run_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, R] (absorbed), q_pe [T, H, P], cache [num_blocks, block_size, R + P] -> [T, H, R]."""
        d, batch = self.dims, self._planned()
        require(d.mla, "run_mla on GQA dims")
        r, p = d.head_dim, d.rope_dim
        check_query("q_nope", q_nope, batch.num_tokens, d.num_heads, r, d.dtype, self.device)
        check_query("q_pe", q_pe, batch.num_tokens, d.num_heads, p, d.dtype, self.device)
        check_tensor("cache", cache, 3, (d.dtype,))
        check_dim("cache", cache, 1, batch.block_size, "the planned block_size")
        check_dim("cache", cache, 2, r + p, "kv_lora_rank + rope_dim")
        require(cache.device == self.device, f"cache is on {cache.device}, device is {self.device}")
        batch.check_blocks_fit(cache.shape[0], "cache")
        paged = cache.view(-1, 1, cache.shape[-1]) if self._token_pages else cache
        return self._active.run(q_nope, q_pe, paged[..., :r], paged[..., r:])


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
