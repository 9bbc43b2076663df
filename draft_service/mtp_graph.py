"""MTP chains as CUDA graphs (the `mtp` drafter, mtp.py): the catch-up over the newly confirmed entries in one replay,
the whole drafted chain in another.

Eager, a propose runs the MTP layer once over the entries its cache lacks (the confirmed tokens with the target's
rows) and once per drafted token after that, through the per-sequence torch attention (which reads lengths on the
host) and the torch MoE reference (which reads the chosen experts on the host). Here both run on fixed buffers over
the drafter's own paged cache:

- attention: a graph-safe paged attention over a window of NB blocks (the Triton paged attention on CUDA where
  triton is installed, else the paged torch one), its block table and lengths in device tensors this module fills
  on the device;
- routed experts: the fused MoE kernels on CUDA in bf16 / fp16 (kernels/fused_moe.py; int4 experts: w4a16), else
  `gathered_experts` (each token's chosen experts gathered and applied: the MoE reference's function, no host read);
- feed graph n (n = 1..feed_max): entries start..start+n-1 from the n confirmed tokens in `feed_ids` and the target's
  rows in `rows` (through the target's final norm), causally; the block's output at the last one (the pending
  token) lands in `out0`;
- chain graph (k, greedy | sampled), k = 1..k_max: draws drafted token 0 from logits(out0), then k - 1 times runs the
  layer on (the drawn token, the block's own output) at entry base + 1 + i and draws the next. Greedy: the argmax,
  as the eager chain. Sampled: a draw from the request's q (graph_sampling.py), q kept for the target's verify.

Before the replays one host-to-device copy (pinned) brings the starts, the feed's token ids and the session's block
table (grown first to cover every entry the chain writes), and one device copy the feed's rows; after them the
chain's tokens (and q) are read once. A feed longer than the feed graphs (the tokens of steps adaptive skipped, a
prompt) runs as several feed replays of feed_max entries, then one of the rest (never eagerly at a length met for the
first time mid-request). Not captured (a CPU, or before capture()), the same bodies run eagerly over the same buffers: CPU
tests compare them with the eager chain. Graphs are captured before any session holds blocks (warm-up and capture
write scratch entries into block 0). The buffers, the paged metadata set on the device, the staging copy and the
draws are model_graph.py's `PagedChainGraphs` (shared with the draft LM's chains).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specserve.contract.types import SamplingParams
from specserve.draft_service.model_graph import PagedChainGraphs, paged_backend
from specserve.models.kv_cache import PagedKVCache


def gathered_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, H]
    """moe_reference's function with no host read (graph-safe in any dtype): each (token, choice) pair's expert
    weights gathered ([T K, 2I, H]: only the chosen experts are read) and applied as one batched matmul each."""
    t, k = topk_ids.shape
    inter = w2.shape[-1]
    ids = topk_ids.reshape(-1)
    x = hidden.repeat_interleave(k, dim=0)[:, :, None]  # [T K, H, 1]
    gate_up = torch.bmm(w13[ids], x)[..., 0]  # [T K, 2I]
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    y = torch.bmm(w2[ids], act[:, :, None])[..., 0].float()  # [T K, H]
    return (y.view(t, k, -1) * topk_weights.float()[..., None]).sum(dim=1).to(hidden.dtype)


def graph_experts_fn(device: torch.device, dtype: torch.dtype):
    """The routed-experts compute the graphs record: the fused kernels where they run, else gathered_experts."""
    from specserve.models.backends import fused_moe_unsupported

    if fused_moe_unsupported(device, dtype):
        return gathered_experts
    from specserve.kernels.fused_moe import fused_moe

    return fused_moe


class MTPChainGraphs(PagedChainGraphs):
    """Feed graphs for 1..feed_max entries and chain graphs for 1..k_max drafted tokens, greedy and sampled, sharing
    one set of static buffers and one memory pool (`chain_start`: the pending token's entry, base; drafted token
    i + 2 reads entry base + 1 + i)."""

    def __init__(
        self,
        layer,
        kv: PagedKVCache,
        block_size: int,
        window: int,
        vocab: int,
        k_max: int,
        feed_max: int,
        attention: str = "paged_torch",
    ) -> None:  # attention: "triton_paged" | "paged_torch"
        dev = kv.device
        backend = paged_backend(attention, layer.block.self_attn, block_size, dev)
        super().__init__(backend, dev, block_size, window, vocab, k_max, feed_max, attention)
        self.layer, self.kv = layer, kv
        self.experts_fn = graph_experts_fn(dev, kv.dtype)
        hidden = layer.config.hidden_size
        self.rows = torch.zeros(feed_max, hidden, dtype=kv.dtype, device=dev)  # [feed_max, H] the feed's target rows
        self.out0 = torch.zeros(1, hidden, dtype=kv.dtype, device=dev)  # [1, H] the block's output at the pending token

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _step(
        self, tokens: torch.Tensor, previous: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv_len: torch.Tensor
    ) -> torch.Tensor:
        """tokens [T] at consecutive entries pos [T] (slots [T], kv_len [1] = pos[-1] + 1) -> the block's output [T, H]."""
        return self.layer.step(tokens, previous, pos, self._attend(tokens.shape[0], pos, slots, kv_len), self.kv)

    def _feed_body(self, n: int) -> None:
        self._bind_table(n)
        pos, slots, kv_lens = self._placed(self.feed_start, n)
        out = self._step(self.feed_ids[:n], self.layer.target_norm(self.rows[:n]), pos, slots, kv_lens[-1:])
        self.out0.copy_(out[n - 1 :])

    def _chain_body(self, k: int, sampled: bool) -> None:
        if k > 1:  # the k - 1 chained entries' positions, slots and lengths, computed once
            self._bind_table(1)
            pos, slots, kv_lens = self._placed(self.chain_start + 1, k - 1)
        h = self.out0
        logits = self.layer.logits(h)  # [1, V]
        for i in range(k):
            tok = self._draw(logits, i, sampled)  # [1]
            if i == k - 1:
                break
            h = self._step(tok, h, pos[i : i + 1], slots[i : i + 1], kv_lens[i : i + 1])
            logits = self.layer.logits(h)

    @contextlib.contextmanager
    def _context(self):
        """The layer's attention through this module's paged backend and its experts through `experts_fn` (the eager
        drafter keeps the torch attention and the MoE reference)."""
        attn, mlp, moe = self.layer.block.self_attn, self.layer.block.mlp, self.layer.block.is_moe
        previous = attn.attn_backend, (mlp.experts_fn if moe else None)
        attn.attn_backend = self.backend
        if moe:
            mlp.experts_fn = self.experts_fn
        try:
            yield
        finally:
            attn.attn_backend = previous[0]
            if moe:
                mlp.experts_fn = previous[1]

    # ---- replay ----------------------------------------------------------------------------------
    def fits(self, seq_len: int, k: int) -> bool:
        """Whether a chain of k after a sequence of seq_len tokens (entries up to seq_len + k - 3) stays in the window."""
        return 1 <= k <= self.k_max and seq_len + k - 2 <= self.window

    @torch.inference_mode()
    def draft(
        self,
        table: Sequence[int],  # the session's block table, covering entries < base + k
        base: int,  # the pending token's entry (len(S) - 2)
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
        feed: tuple[np.ndarray, torch.Tensor, int] | None = None,  # (ids [n], target rows [n, H], start): fed entries
        out0: torch.Tensor | None = None,  # [H] the block's output at the pending token, when the feed ran eagerly
    ) -> tuple[list[int], torch.Tensor | None]:  # k drafted ids, q [k, V] float32 (sampled) or None
        if feed is None:
            self._stage(table, base, None, 0)
            self.out0.copy_(out0[None])
        else:
            self.feed(table, base, *feed)
        return self._chain(k, sampling, generator)

    @torch.inference_mode()
    def feed(
        self,
        table: Sequence[int],  # the session's block table, covering entries < start + n
        base: int,  # the pending token's entry (len(S) - 2)
        ids: np.ndarray,  # [n <= feed_max] the confirmed tokens fed at entries start .. start + n - 1
        rows: torch.Tensor,  # [n, H] their target rows
        start: int,
    ) -> None:
        """One feed replay: n entries from the confirmed tokens and the target's rows (out0: the block's output at the
        last; a long catch-up is several of these, then the propose's)."""
        self._stage(table, base, ids, start)
        self.rows[: len(ids)].copy_(rows)
        self._run(("feed", len(ids)))
