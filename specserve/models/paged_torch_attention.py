"""Paged attention in plain torch with static shapes: the CUDA-graph-safe path for models FlashInfer cannot serve.

FlashInfer covers GQA head dims 64/128/256 and MLA (512, 64). Other sizes (the shipped demo's MLA latent 64 / rope
16, tiny test presets) ran the per-sequence torch loop of models/attention.py, which reads lengths on the host and
so cannot be captured. This backend attends every new token over a fixed window of key positions instead:

- a step's metadata lives in device tensors of fixed shape (`PagedStep`): block tables [B, NB] (NB blocks cover
  the step's maximum kv length), cached lengths [B], and per new token its request and its mask over its request's
  new tokens [T, Q] (causal for chains, the tree mask for trees);
- each layer writes this step's K/V (or MLA latent + rope key) at the step's slots, gathers the keys of the
  window [B, NB * block_size] through the block table, and masks key j of row t as visible when j is a cached
  position of t's request (j < context) or a new token t may see (0 <= j - context < Q and mask[t, j - context]).

Nothing reads a length on the host, so a graph captured over `gqa` / `mla` replays correctly after
`prepare(attn, step)` refills the step's buffers (host-to-device copies from pinned memory, no synchronisation).
The work is O(T x window) per layer: meant for small models and small windows (the demo: 2048 positions), not as
a replacement for FlashInfer on large ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import MLAConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.paged_backend import PagedBackend


class PagedTorchError(ValueError):
    """A step that does not fit the static shape it was prepared into."""


@dataclass(frozen=True)
class StepShape:
    """The fixed shape of one step's buffers."""

    num_requests: int  # B
    num_tokens: int  # T new tokens over the batch
    max_new: int  # Q: most new tokens of one request
    num_blocks: int  # NB block-table entries per request (window = NB * block_size key positions)


class PagedStep:
    """The device metadata of one step shape (eager: sized to its batch; graph: the graph's fixed shape)."""

    def __init__(self, shape: StepShape, device: torch.device, pinned: bool) -> None:
        b, t, q, nb = shape.num_requests, shape.num_tokens, shape.max_new, shape.num_blocks
        self.shape = shape
        self.block_tables = torch.zeros(b, nb, dtype=torch.int64, device=device)  # [B, NB]
        self.context_lens = torch.zeros(b, dtype=torch.int64, device=device)  # [B]
        self.row_request = torch.zeros(t, dtype=torch.int64, device=device)  # [T]
        self.new_mask = torch.zeros(t, q, dtype=torch.bool, device=device)  # [T, Q]
        self._host = {  # staging copies (pinned on CUDA, so the copies never synchronise)
            name: torch.zeros(buf.shape, dtype=buf.dtype, pin_memory=pinned)
            for name, buf in self._buffers().items()
        }
        # marks the last copies out of the staging buffers: refilling them waits for it (never in practice: a step
        # ends with a device-to-host read of its results, long after its metadata copies ran)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"block_tables": self.block_tables, "context_lens": self.context_lens,
                "row_request": self.row_request, "new_mask": self.new_mask}

    def fill(self, attn: AttentionBatch, block_size: int) -> None:
        """Write attn's metadata into the staging copies on the host, then copy them to the device buffers."""
        s = self.shape
        if attn.num_seqs != s.num_requests or attn.num_tokens != s.num_tokens or max(attn.query_lens) > s.max_new:
            raise PagedTorchError(f"step {attn.query_lens} does not fit the step shape {s}")
        h = self._host
        if self._copied is not None:
            self._copied.synchronize()
        for t in h.values():
            t.zero_()
        for b, ((start, end), ctx, table, mask) in enumerate(
            zip(attn.token_ranges(), attn.context_lens, attn.block_tables, attn.tree_masks)
        ):
            q = end - start
            need = -(-(ctx + q) // block_size)
            if need > s.num_blocks:
                raise PagedTorchError(f"request {b} needs {need} blocks, the step holds {s.num_blocks}")
            h["block_tables"][b, :need] = torch.tensor(table[:need], dtype=torch.int64)
            h["context_lens"][b] = ctx
            h["row_request"][start:end] = b
            h["new_mask"][start:end, :q] = torch.ones(q, q, dtype=torch.bool).tril() if mask is None else mask.cpu()
        for name, buf in self._buffers().items():
            buf.copy_(h[name], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def key_mask(self, block_size: int) -> torch.Tensor:  # [T, NB * block_size] bool
        """Which window positions each new token may see (device ops only)."""
        window = self.shape.num_blocks * block_size
        rel = torch.arange(window, device=self.context_lens.device)[None, :] - self.context_lens[self.row_request][:, None]
        q = self.shape.max_new
        in_new = (rel >= 0) & (rel < q)
        new_ok = torch.gather(self.new_mask, 1, rel.clamp(0, q - 1)) & in_new
        return (rel < 0) | new_ok


def _window(cache: torch.Tensor, step: PagedStep) -> torch.Tensor:  # [B, NB * block_size, ...]
    """The window's cache entries per request, gathered through the block table."""
    b, nb = step.block_tables.shape
    rows = cache[step.block_tables.reshape(-1)]  # [B * NB, block_size, ...]
    return rows.reshape(b, nb * cache.shape[1], *cache.shape[2:])


class PagedTorchBackend(PagedBackend):
    """The model's graph-safe torch attention: `prepare` per step, then every layer's `gqa` / `mla`."""

    error = PagedTorchError
    what = "paged torch attention"

    def __init__(self, attn_module: torch.nn.Module, block_size: int, device: torch.device | str) -> None:
        super().__init__(block_size)
        self.scale = float(attn_module.scale)
        self.mla_dims = (
            (attn_module.cfg.kv_lora_rank, attn_module.cfg.qk_rope_head_dim)
            if isinstance(attn_module.cfg, MLAConfig) else None
        )
        self.device = torch.device(device)

    def new_graph_step(self, shape) -> PagedStep:
        """The buffers of a CUDA-graph step (shape: kernels.attention.GraphShape)."""
        q = max(shape.query_lens)
        nb = -(-shape.max_kv_len // self.block_size)
        return PagedStep(StepShape(len(shape.query_lens), sum(shape.query_lens), q, nb), self.device,
                         pinned=self.device.type == "cuda")

    def _plan(self, attn: AttentionBatch, step: PagedStep | None) -> PagedStep:
        """Fill this step's buffers (a new eager step's, or a graph runner's)."""
        if step is None:
            kv = max(c + q for c, q in zip(attn.context_lens, attn.query_lens))
            shape = StepShape(attn.num_seqs, attn.num_tokens, max(attn.query_lens), -(-kv // self.block_size))
            step = PagedStep(shape, self.device, pinned=False)
        step.fill(attn, self.block_size)
        return step

    def bind(self, attn: AttentionBatch, step: PagedStep) -> None:
        """Serve `attn` from `step`'s buffers as they are, without filling them: for a CUDA graph that sets the lengths,
        block table and slots on the device itself (draft_service/model_graph.py); forward's prepare is then a no-op."""
        self._step, self._prepared_for = step, attn

    def gqa_cached(self, layer: int, q: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """q [T, Hq, D] over a cache that already holds this step's K/V -> [T, Hq, D]."""
        step = self._planned(attn)
        kv = _window(kv_cache.layers[layer], step)[step.row_request]  # [T, W, 2, Hkv, D]
        t, hq, d = q.shape
        hkv = kv.shape[3]
        qg = q.float().view(t, hkv, hq // hkv, d)  # [T, Hkv, G, D]
        scores = torch.einsum("tkgd,twkd->tkgw", qg, kv[:, :, 0].float()) * self.scale
        scores = scores.masked_fill(~step.key_mask(self.block_size)[:, None, None, :], float("-inf"))
        out = torch.einsum("tkgw,twkd->tkgd", torch.softmax(scores, dim=-1), kv[:, :, 1].float())
        return out.reshape(t, hq, d).to(q.dtype)

    def mla_cached(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch,
                   kv_cache: PagedKVCache) -> torch.Tensor:
        """Absorbed MLA over a cache that already holds this step's entries -> [T, H, R]."""
        step = self._planned(attn)
        r = q_nope.shape[-1]
        win = _window(kv_cache.layers[layer], step)[step.row_request].float()  # [T, W, R + P]
        latent, k_pe = win[..., :r], win[..., r:]
        scores = (torch.einsum("thr,twr->thw", q_nope.float(), latent)
                  + torch.einsum("thp,twp->thw", q_pe.float(), k_pe)) * self.scale
        scores = scores.masked_fill(~step.key_mask(self.block_size)[:, None, :], float("-inf"))
        return torch.einsum("thw,twr->thr", torch.softmax(scores, dim=-1), latent).to(q_nope.dtype)
