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

`invariant=True` (the target's invariant steps, and its CPU path) makes a row's output independent of how many rows
and keys the step carries, bit for bit: each row reads its keys in position order (the cache, then its own path of
new tokens: for a tree node its ancestors by depth, so a node sees its keys where a one-token decode of its path
would) and reduces over them in fixed chunks of INVARIANT_CHUNK key positions with an online softmax, in chunk
order (a chunk it sees nothing of leaves the running state exactly as it was). Pad rows (AttentionBatch.pad_rows)
read the last new token's keys (the dense ops cost the same whatever they read); they write no K/V (slot -1) and
their outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.paged_rows import tree_paths_of
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.config import MLAConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.paged_backend import PagedBackend

INVARIANT_CHUNK = 64  # key positions reduced at once by an invariant step (any fixed size gives the invariance)
_M_INIT = -1.0e30  # finite start for the running max: a chunk that sees nothing then gives p = 0, never NaN


class PagedTorchError(ValueError):
    """A step that does not fit the static shape it was prepared into."""


@dataclass(frozen=True)
class StepShape:
    """The fixed shape of one step's buffers."""

    num_requests: int  # B
    num_tokens: int  # T rows over the batch (new tokens, then pad rows)
    max_new: int  # Q: most new tokens of one request
    num_blocks: int  # NB block-table entries per request (window = NB * block_size key positions)


class PagedStep:
    """The device metadata of one step shape (eager: sized to its batch; graph: the graph's fixed shape)."""

    def __init__(self, shape: StepShape, device: torch.device, pinned: bool, paths: bool = False) -> None:
        b, t, q, nb = shape.num_requests, shape.num_tokens, shape.max_new, shape.num_blocks
        self.shape = shape
        self.paths = paths  # fill the rows' paths too (invariant steps: key_order reads them)
        self.block_tables = torch.zeros(b, nb, dtype=torch.int64, device=device)  # [B, NB]
        self.context_lens = torch.zeros(b, dtype=torch.int64, device=device)  # [B]
        self.row_request = torch.zeros(t, dtype=torch.int64, device=device)  # [T]
        self.new_mask = torch.zeros(t, q, dtype=torch.bool, device=device)  # [T, Q]
        self.depth = torch.zeros(t, dtype=torch.int64, device=device)  # [T] new tokens the row sees, minus one
        self.path = torch.zeros(t, q, dtype=torch.int64, device=device)  # [T, Q] the new tokens it sees, in order
        self._host = {  # staging copies (pinned on CUDA, so the copies never synchronise)
            name: torch.zeros(buf.shape, dtype=buf.dtype, pin_memory=pinned) for name, buf in self._buffers().items()
        }
        # marks the last copies out of the staging buffers: refilling them waits for it (never in practice: a step
        # ends with a device-to-host read of its results, long after its metadata copies ran)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {
            "block_tables": self.block_tables,
            "context_lens": self.context_lens,
            "row_request": self.row_request,
            "new_mask": self.new_mask,
            "depth": self.depth,
            "path": self.path,
        }

    def fill(self, attn: AttentionBatch, block_size: int) -> None:
        """Write attn's metadata into the staging copies on the host, then copy them to the device buffers."""
        s = self.shape
        if attn.num_seqs != s.num_requests or attn.num_rows != s.num_tokens or max(attn.query_lens) > s.max_new:
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
            own = torch.ones(q, q, dtype=torch.bool).tril() if mask is None else mask.cpu()
            h["new_mask"][start:end, :q] = own
            if self.paths:
                h["path"][start:end, :q], h["depth"][start:end] = tree_paths_of(own)  # a tree node: its ancestors
        if attn.pad_rows:  # pad rows read the last new token's keys (no cheaper row in dense ops; ignored anyway)
            last = attn.num_tokens - 1
            for name in ("row_request", "new_mask", "depth", "path"):
                h[name][attn.num_tokens :] = h[name][last]
        for name, buf in self._buffers().items():
            buf.copy_(h[name], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def key_mask(self, block_size: int) -> torch.Tensor:  # [T, NB * block_size] bool
        """Which window positions each new token may see (device ops only)."""
        window = self.shape.num_blocks * block_size
        rel = (
            torch.arange(window, device=self.context_lens.device)[None, :]
            - self.context_lens[self.row_request][:, None]
        )
        q = self.shape.max_new
        in_new = (rel >= 0) & (rel < q)
        new_ok = torch.gather(self.new_mask, 1, rel.clamp(0, q - 1)) & in_new
        return (rel < 0) | new_ok

    def key_order(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, window] int64, [T, window] bool)
        """Invariant steps: (window index of each row's k-th key in position order, whether the row sees it)."""
        ctx = self.context_lens[self.row_request][:, None]  # [T, 1]
        k = torch.arange(window, device=ctx.device)[None, :]
        rel = k - ctx
        node = torch.gather(self.path, 1, rel.clamp(0, self.shape.max_new - 1))
        src = torch.where(rel < 0, k, ctx + node).clamp(max=window - 1)
        return src, rel <= self.depth[:, None]


def _window(cache: torch.Tensor, step: PagedStep) -> torch.Tensor:  # [B, NB * block_size, ...]
    """The window's cache entries per request, gathered through the block table."""
    b, nb = step.block_tables.shape
    rows = cache[step.block_tables.reshape(-1)]  # [B * NB, block_size, ...]
    return rows.reshape(b, nb * cache.shape[1], *cache.shape[2:])


class PagedTorchBackend(PagedBackend):
    """The model's graph-safe torch attention: `prepare` per step, then every layer's `gqa` / `mla`."""

    error = PagedTorchError
    what = "paged torch attention"

    def __init__(
        self, attn_module: torch.nn.Module, block_size: int, device: torch.device | str, invariant: bool = False
    ) -> None:
        super().__init__(block_size)
        self.invariant = invariant  # rows in position order, fixed-chunk reductions (the module docstring)
        self.scale = float(attn_module.scale)
        self.mla_dims = (
            (attn_module.cfg.kv_lora_rank, attn_module.cfg.qk_rope_head_dim)
            if isinstance(attn_module.cfg, MLAConfig)
            else None
        )
        self.device = torch.device(device)

    def new_graph_step(self, shape) -> PagedStep:
        """The buffers of a CUDA-graph step (shape: kernels.attention.GraphShape)."""
        q = max(shape.query_lens)
        nb = -(-shape.max_kv_len // self.block_size)
        return PagedStep(
            StepShape(len(shape.query_lens), sum(shape.query_lens), q, nb),
            self.device,
            pinned=self.device.type == "cuda",
            paths=self.invariant,
        )

    def _plan(self, attn: AttentionBatch, step: PagedStep | None) -> PagedStep:
        """Fill this step's buffers (a new eager step's, or a graph runner's)."""
        if step is None:
            kv = max(c + q for c, q in zip(attn.context_lens, attn.query_lens))
            shape = StepShape(attn.num_seqs, attn.num_rows, max(attn.query_lens), -(-kv // self.block_size))
            step = PagedStep(shape, self.device, pinned=False, paths=self.invariant)
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
        if self.invariant:
            keys, seen = self._ordered(kv, step)  # [T, W', 2, Hkv, D], [T, W']
            out = _chunked_softmax(
                lambda c: torch.einsum("tkgd,tckd->tkgc", qg, keys[:, c, 0].float()) * self.scale,
                lambda p, c: torch.einsum("tkgc,tckd->tkgd", p, keys[:, c, 1].float()),
                seen[:, None, None, :],
                keys.shape[1],
                (t, hkv, hq // hkv, d),
                q.device,
            )
            return out.reshape(t, hq, d).to(q.dtype)
        scores = torch.einsum("tkgd,twkd->tkgw", qg, kv[:, :, 0].float()) * self.scale
        scores = scores.masked_fill(~step.key_mask(self.block_size)[:, None, None, :], float("-inf"))
        out = torch.einsum("tkgw,twkd->tkgd", torch.softmax(scores, dim=-1), kv[:, :, 1].float())
        return out.reshape(t, hq, d).to(q.dtype)

    def mla_cached(
        self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor, attn: AttentionBatch, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """Absorbed MLA over a cache that already holds this step's entries -> [T, H, R]."""
        step = self._planned(attn)
        r = q_nope.shape[-1]
        win = _window(kv_cache.layers[layer], step)[step.row_request].float()  # [T, W, R + P]
        if self.invariant:
            keys, seen = self._ordered(win, step)  # [T, W', R + P], [T, W']
            qn, qp = q_nope.float(), q_pe.float()
            out = _chunked_softmax(
                lambda c: (
                    (
                        torch.einsum("thr,tcr->thc", qn, keys[:, c, :r])
                        + torch.einsum("thp,tcp->thc", qp, keys[:, c, r:])
                    )
                    * self.scale
                ),
                lambda p, c: torch.einsum("thc,tcr->thr", p, keys[:, c, :r]),
                seen[:, None, :],
                keys.shape[1],
                tuple(q_nope.shape),
                q_nope.device,
            )
            return out.to(q_nope.dtype)
        latent, k_pe = win[..., :r], win[..., r:]
        scores = (
            torch.einsum("thr,twr->thw", q_nope.float(), latent) + torch.einsum("thp,twp->thw", q_pe.float(), k_pe)
        ) * self.scale
        scores = scores.masked_fill(~step.key_mask(self.block_size)[:, None, :], float("-inf"))
        return torch.einsum("thw,twr->thr", torch.softmax(scores, dim=-1), latent).to(q_nope.dtype)

    def _ordered(self, window: torch.Tensor, step: PagedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's window [T, W, ...] re-read in position order and padded to whole chunks: ([T, W', ...], which
        keys the row sees [T, W'] bool)."""
        w = window.shape[1]
        src, seen = step.key_order(w)
        width = -(-w // INVARIANT_CHUNK) * INVARIANT_CHUNK
        if width > w:  # whole chunks: the extra positions are seen by nobody
            src = torch.nn.functional.pad(src, (0, width - w))
            seen = torch.nn.functional.pad(seen, (0, width - w))
        index = src.view(*src.shape, *([1] * (window.dim() - 2))).expand(*src.shape, *window.shape[2:])
        return torch.gather(window, 1, index), seen


def _chunked_softmax(
    scores, values, seen: torch.Tensor, width: int, out_shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:  # out_shape, float32
    """softmax(scores) @ values over `width` key positions, INVARIANT_CHUNK at a time in order (online softmax).

    scores(c) -> [..., C] for the chunk slice c, values(p, c) -> [..., Dv] (p: [..., C]); seen [..., width] bool
    broadcasting against the scores. Every chunk has the same shape, so every row's result depends only on the keys
    it sees and their positions; a chunk it sees nothing of multiplies its state by exp(0) = 1 and adds 0."""
    m = torch.full(out_shape[:-1], _M_INIT, dtype=torch.float32, device=device)
    lsum = torch.zeros(out_shape[:-1], dtype=torch.float32, device=device)
    acc = torch.zeros(out_shape, dtype=torch.float32, device=device)
    for start in range(0, width, INVARIANT_CHUNK):
        c = slice(start, start + INVARIANT_CHUNK)
        s = scores(c).masked_fill(~seen[..., c], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        lsum = lsum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + values(p, c)
        m = m_new
    return acc / lsum.clamp(min=1e-30)[..., None]
