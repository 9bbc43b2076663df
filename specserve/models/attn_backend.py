"""Attention backend selection and the model side of FlashInfer (plan once per step, run once per layer).

`select_attention_backend` is the one place that decides between the plain-torch attention in models/attention.py
and FlashInfer. The FlashInfer kernels and their wrappers live in specserve.kernels.attention (`StepAttention`:
the wrappers of one step shape, eager or CUDA-graph mode). Here:

- `FlashInferBackend`: owned by the model (`CausalLM.set_attention_backend`); `prepare(attn)` plans a step (eager:
  its own StepAttention; a graph runner passes the graph's), then each attention layer calls `gqa` / `mla`, which
  write this step's cache entries (no checks, no host syncs) and run the planned wrapper.
- `ReferencePagedBackend`: the same plumbing over the pure-torch paged references, for CPU tests.
"""

from __future__ import annotations

import torch

from specserve.kernels.attention import (
    FLASHINFER_IMPORT_ERROR,
    GQA_HEAD_DIMS,
    HAS_FLASHINFER,
    MLA_DIMS,
    AttnDims,
    GraphShape,
    StepAttention,
    new_workspace,
)
from specserve.kernels.paged_batch import PagedBatch
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import GQAConfig, MLAConfig, ModelConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.paged_backend import PagedBackend

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer", "triton_paged", "paged_torch")


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


def paged_torch_unsupported(config: ModelConfig) -> str:
    """Why the graph-safe torch paged attention cannot run this model ('' when it can; it runs on any device)."""
    att = config.attention
    if isinstance(att, GQAConfig) and att.sliding_window is not None:
        return "sliding-window attention"
    if not isinstance(att, (GQAConfig, MLAConfig)):
        return f"attention kind {type(att).__name__}"
    return ""


def triton_paged_unsupported(config: ModelConfig, device: torch.device | str) -> str:
    """Why the Triton paged attention of any head size cannot run this model here ('' when it can)."""
    from specserve.kernels.paged_attention import HAS_TRITON

    if torch.device(device).type != "cuda":
        return f"device {device} is not CUDA"
    if not HAS_TRITON:
        return "triton is not installed"
    return paged_torch_unsupported(config)  # same coverage: GQA without a sliding window, and MLA


def select_attention_backend(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, requested: str = "auto"
) -> str:
    """'torch', 'flashinfer', 'triton_paged' or 'paged_torch'. 'auto' takes FlashInfer where it can run, else on CUDA
    the Triton paged attention of any head size (specserve/models/triton_paged_attention.py), else the graph-safe
    torch paged attention (paged_torch_attention.py), else the per-sequence torch path; asking for one where it
    cannot run is an error."""
    if requested not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    why = flashinfer_unsupported(config, device, dtype)
    if requested == "flashinfer" and why:
        raise AttentionBackendError(f"FlashInfer attention cannot run here: {why}")
    why_paged = paged_torch_unsupported(config)
    why_triton = triton_paged_unsupported(config, device)
    if requested == "triton_paged":
        if why_triton:
            raise AttentionBackendError(f"Triton paged attention cannot run here: {why_triton}")
        return "triton_paged"
    if requested == "paged_torch":
        if why_paged:
            raise AttentionBackendError(f"paged torch attention cannot run here: {why_paged}")
        return "paged_torch"
    if not why:
        return "flashinfer"
    if not why_triton:
        return "triton_paged"
    on_cuda = torch.device(device).type == "cuda"  # the CPU keeps the per-sequence torch path it always had
    return "paged_torch" if on_cuda and not why_paged else "torch"


def attn_dims_of(attn_module: torch.nn.Module, dtype: torch.dtype) -> AttnDims:
    """The kernels' per-rank attention sizes of one of the model's attention layers."""
    cfg = attn_module.cfg
    if isinstance(cfg, MLAConfig):
        return AttnDims(
            True, attn_module.num_heads, 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim, float(attn_module.scale), dtype
        )
    return AttnDims(
        False, attn_module.num_heads, attn_module.num_kv_heads, cfg.head_dim, 0, float(attn_module.scale), dtype
    )


def paged_batch_of(attn: AttentionBatch, block_size: int) -> PagedBatch:
    """The kernels' CSR metadata of an AttentionBatch (host only; a batch without pad rows)."""
    if attn.pad_rows:
        raise AttentionBackendError(
            f"this attention backend cannot pad a step ({attn.pad_rows} pad rows): the "
            "invariant steps run on triton_paged or paged_torch"
        )
    return PagedBatch.build(attn.query_lens, attn.context_lens, attn.block_tables, block_size, attn.tree_masks)


class FlashInferBackend(PagedBackend):
    """The model's FlashInfer attention: plans one StepAttention per step and serves every layer from it
    (its cache writes take every slot >= 0)."""

    error = AttentionBackendError
    what = "FlashInfer attention"

    def __init__(
        self, attn_module: torch.nn.Module, block_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        if not HAS_FLASHINFER:
            raise AttentionBackendError(f"flashinfer is not importable ({FLASHINFER_IMPORT_ERROR or 'not installed'})")
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # 'cuda' -> 'cuda:N' so device checks compare equal
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(block_size)
        self.device = dev
        self.dims = attn_dims_of(attn_module, dtype)
        self.workspace = new_workspace(self.device)
        self._eager = StepAttention(self.dims, block_size, self.device, self.workspace)

    def new_graph_step(self, shape: GraphShape) -> StepAttention:
        return StepAttention(self.dims, self.block_size, self.device, self.workspace, shape)

    def _plan(self, attn: AttentionBatch, step: StepAttention | None) -> StepAttention:
        """Plan this step (in the eager step, or a graph runner's)."""
        step = step or self._eager
        step.plan(paged_batch_of(attn, self.block_size))
        return step

    def gqa_cached(self, layer: int, q: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """q [T, Hq, D] over a cache that already holds this step's K/V -> [T, Hq, D]."""
        return self._planned(attn).run_gqa(q.contiguous(), kv_cache.layers[layer])

    def mla_cached(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed MLA over a cache that already holds this step's entries -> [T, H, R]."""
        return self._planned(attn).run_mla(q_nope.contiguous(), q_pe.contiguous(), kv_cache.layers[layer])


class ReferencePagedBackend(PagedBackend):
    """The fast path's plumbing (prepare per step, cache writes by slot, absorbed MLA) over the pure-torch paged
    references of specserve.kernels.attention_reference: runs anywhere, so CPU tests check that plumbing
    against the plain-torch attention of models/attention.py."""

    error = AttentionBackendError
    what = "reference attention"

    def __init__(self, attn_module: torch.nn.Module, block_size: int) -> None:
        super().__init__(block_size)
        self.scale = float(attn_module.scale)

    def _plan(self, attn: AttentionBatch, step: object) -> PagedBatch:
        if step is not None:
            raise AttentionBackendError("the reference backend has no CUDA-graph steps")
        return paged_batch_of(attn, self.block_size)

    def gqa_cached(self, layer: int, q: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        from specserve.kernels.attention_reference import paged_attention_reference

        return paged_attention_reference(q, kv_cache.layers[layer], self._planned(attn), self.scale)

    def mla_cached(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        from specserve.kernels.attention_reference import mla_attention_reference

        return mla_attention_reference(q_nope, q_pe, kv_cache.layers[layer], self._planned(attn), self.scale)


def make_attention_backend(
    model: torch.nn.Module,
    kind: str,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype,
    invariant: bool = False,
):
    """The backend object for a kind from select_attention_backend ('torch' -> None) or 'reference'; invariant:
    its token-count invariant form (triton_paged and paged_torch only)."""
    if invariant and kind not in ("triton_paged", "paged_torch"):
        raise AttentionBackendError(f"the {kind!r} attention has no invariant form")
    attn_module = model.model.layers[0].self_attn
    if kind == "torch":
        return None
    if kind == "flashinfer":
        return FlashInferBackend(attn_module, block_size, device, dtype)
    if kind == "reference":
        return ReferencePagedBackend(attn_module, block_size)
    if kind == "triton_paged":
        from specserve.models.triton_paged_attention import TritonPagedBackend

        return TritonPagedBackend(
            attn_module, block_size, device, invariant=invariant, max_window=model.config.max_position_embeddings
        )
    if kind == "paged_torch":
        from specserve.models.paged_torch_attention import PagedTorchBackend

        return PagedTorchBackend(attn_module, block_size, device, invariant=invariant)
    raise AttentionBackendError(f"unknown attention backend kind {kind!r}")
