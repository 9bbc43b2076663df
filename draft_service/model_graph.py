"""The draft LM's steps as CUDA graphs (the `model` drafter, model_drafter.py): the catch-up feed and the whole chain.

Eager, a propose is one forward per token, each of a new shape, through the per-sequence torch attention (which reads
lengths on the host). Here every forward runs on fixed buffers over the drafter's own paged cache, through a
graph-safe paged attention over a fixed window of NB blocks whose metadata (block table, lengths) lives in device
tensors that this module fills on the device: on CUDA the Triton paged attention (models/triton_paged_attention.py:
one launch per layer), elsewhere the paged torch attention (models/paged_torch_attention.py; CPU tests run it):

- feed graph n (n = 1..feed_max): feeds the n tokens the session's cache lacks (accepted tokens + the pending token)
  at cache positions start..start+n-1, causally, and keeps the last row's logits in `logits0` [V];
- chain graph (k, greedy | sampled), k = 1..k_max: draws drafted token 0 from `logits0`, then k - 1 times writes the
  last drawn token in place as the next input at position ctx + i (its cache slot read from the block table on the
  device), runs one forward, and draws the next token from its logits. Greedy: the argmax, as the eager chain.
  Sampled: a draw from the request's q (graph_sampling.py), q kept for the target's verify.

Before the replays, one host-to-device copy (pinned) brings the two start positions, the feed's token ids and the
session's block table (grown first to cover every position the chain writes); after them the chain's tokens (and q)
are read once. A feed too long for the feed graphs (a prompt) runs eagerly and its logits are copied into `logits0`.
Not captured (a CPU, or before capture()), the same bodies run eagerly over the same buffers: CPU tests check them.
Graphs are captured before any session holds blocks: warm-up and capture write scratch K/V into block 0.

`PagedChainGraphs` holds what is not the draft LM's (the buffers, the paged metadata set on the device, the staging
copy, the draws): the MTP layer's chains (mtp_graph.py) run on it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_capture import GraphBodies, StagedBuffer
from specserve.draft_service.graph_sampling import GraphSampler
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache


def paged_backend(kind: str, attn_module, block_size: int, device: torch.device):
    """The graph-safe paged attention of `kind` ("triton_paged" | "paged_torch") for a model's attention module."""
    if kind == "triton_paged":
        from specserve.models.triton_paged_attention import TritonPagedBackend

        return TritonPagedBackend(attn_module, block_size, device)
    from specserve.models.paged_torch_attention import PagedTorchBackend

    return PagedTorchBackend(attn_module, block_size, device)


class PagedChainGraphs(GraphBodies):
    """Feed graphs ("feed", n) for 1..feed_max tokens and chain graphs ("chain", k, sampled) for 1..k_max drafted
    tokens over a drafter's paged cache: the static buffers and the device-side paged metadata they share. A subclass
    gives `_feed_body(n)` and `_chain_body(k, sampled)` (and `_context()`: its model through `backend`)."""

    def __init__(
        self,
        backend,
        device: torch.device,
        block_size: int,
        window: int,
        vocab: int,
        k_max: int,
        feed_max: int,
        attention: str,
    ) -> None:  # attention: "triton_paged" | "paged_torch"
        super().__init__(device)
        self.backend, self.block_size, self.vocab = backend, block_size, vocab
        self.k_max, self.feed_max, self.attention = k_max, feed_max, attention
        self.num_blocks = max(1, window // block_size)  # NB: the attention window in blocks
        self.window = self.num_blocks * block_size  # positions a chain may reach
        n_args = 2 + feed_max + self.num_blocks
        self._staged = StagedBuffer(n_args, torch.int64, device)
        self.args = self._staged.values  # [2 + feed_max + NB]
        self.feed_start = self.args[0]  # 0-dim: cache position of the feed's first token
        self.chain_start = self.args[1]  # 0-dim: where the chain starts (the draft LM: len(S); MTP: the pending entry)
        self.feed_ids = self.args[2 : 2 + feed_max]  # [feed_max]
        self.table = self.args[2 + feed_max :]  # [NB] the session's block table, zero-padded
        self.tokens = torch.zeros(k_max, dtype=torch.int64, device=device)  # [k_max] drafted ids
        self.sampler = GraphSampler(k_max, vocab, device)
        self._arange = torch.arange(max(feed_max, k_max, 1), dtype=torch.int64, device=device)
        # the backend's step of each forward size (PagedStep or RowsStep): block table [1, NB], lengths, causal rows
        self._steps = {t: self._new_step(t) for t in range(1, max(feed_max, 1) + 1)}

    def _new_step(self, t: int):
        from specserve.kernels.attention import GraphShape

        step = self.backend.new_graph_step(GraphShape((t,), False, self.window))
        if self.attention == "triton_paged":  # rows 0..t-1 of request 0, causal among themselves
            step.rows.row_index.copy_(torch.arange(t))
        else:
            step.new_mask.copy_(torch.ones(t, t, dtype=torch.bool).tril())  # row_request stays 0 (one request)
        return step

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _placed(self, start: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cache positions start..start+n-1 (start: 0-dim): (positions [n], their slots [n], kv lengths [n] = pos + 1)."""
        pos = start + self._arange[:n]
        slots = self.table.gather(0, pos // self.block_size) * self.block_size + pos % self.block_size
        return pos, slots, pos + 1

    def _bind_table(self, t: int) -> None:
        """The session's block table into the step of T-token forwards (once per graph: it does not change within)."""
        step = self._steps[t]
        (step.rows.block_tables if self.attention == "triton_paged" else step.block_tables)[0].copy_(self.table)

    def _attend(self, t: int, pos: torch.Tensor, slots: torch.Tensor, kv_len: torch.Tensor) -> AttentionBatch:
        """The batch of a T-token forward at consecutive cache positions pos [T] (slots [T]; kv_len [1] = pos[-1] + 1),
        its lengths written into the step's buffers on the device and the step bound to the backend."""
        step = self._steps[t]
        if self.attention == "triton_paged":
            step.rows.kv_lens.copy_(kv_len)  # cached + new (int32)
            step.rows.new_starts.copy_(pos[:1])
        else:
            step.context_lens.copy_(pos[:1])
        # a fresh batch object per forward: its slot_mapping is this forward's slots; its host lengths are unused
        attn = AttentionBatch(
            query_lens=(t,), context_lens=(0,), block_tables=((0,),), slot_mapping=slots, tree_masks=(None,)
        )
        self.backend.bind(attn, step)
        return attn

    def _draw(self, logits: torch.Tensor, i: int, sampled: bool) -> torch.Tensor:  # [1, V] -> [1] drafted token i
        tok = self.sampler.draw(logits, i, i + 1) if sampled else logits.argmax(dim=-1)
        self.tokens[i : i + 1].copy_(tok)
        return tok

    def _feed_body(self, n: int) -> None:
        raise NotImplementedError

    def _chain_body(self, k: int, sampled: bool) -> None:
        raise NotImplementedError

    def _body(self, key: tuple) -> None:
        if key[0] == "feed":
            self._feed_body(key[1])
        else:
            self._chain_body(key[1], key[2])

    def _keys(self) -> list[tuple]:
        feeds = [("feed", n) for n in range(self.feed_max, 0, -1)]
        return feeds + [("chain", k, s) for k in range(self.k_max, 0, -1) for s in (True, False)]

    # ---- replay ----------------------------------------------------------------------------------
    def feeds(self, n: int) -> bool:
        return 1 <= n <= self.feed_max

    def _stage(self, table: Sequence[int], chain_start: int, feed_ids: np.ndarray | None, feed_start: int) -> None:
        """The propose's one pinned host-to-device copy: the two starts, the feed's ids and the block table."""
        h = self._staged.host()
        h[:] = 0
        h[0], h[1] = feed_start, chain_start
        if feed_ids is not None:
            h[2 : 2 + len(feed_ids)] = feed_ids
        h[2 + self.feed_max : 2 + self.feed_max + len(table)] = table
        self._staged.send()

    def _chain(
        self, k: int, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """The chain's replay after the feed: k drafted ids (the propose's one device read; q [k, V] follows it)."""
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        self._run(("chain", k, sampled))
        tokens = self.tokens[:k].tolist()
        return tokens, (self.sampler.q[:k].clone() if sampled else None)


class ModelChainGraphs(PagedChainGraphs):
    """Feed graphs for 1..feed_max tokens and chain graphs for 1..k_max drafted tokens, greedy and sampled, sharing one
    set of static buffers and one memory pool."""

    def __init__(
        self,
        model,
        kv: PagedKVCache,
        block_size: int,
        window: int,
        vocab: int,
        k_max: int,
        feed_max: int,
        attention: str = "paged_torch",
    ) -> None:  # attention: "triton_paged" | "paged_torch"
        backend = paged_backend(attention, model.model.layers[0].self_attn, block_size, kv.device)
        super().__init__(backend, kv.device, block_size, window, vocab, k_max, feed_max, attention)
        self.model, self.kv = model, kv
        self.logits0 = torch.zeros(vocab, dtype=torch.float32, device=kv.device)  # [V] logits after the pending token

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
        """ids [T] at consecutive cache positions pos [T] (slots [T]; kv_len [1] = pos[-1] + 1) -> logits [T, V]."""
        out = self.model(ids, pos, self._attend(ids.shape[0], pos, slots, kv_len), self.kv)
        return self.model.compute_logits(out.hidden)[:, : self.vocab]

    def _feed_body(self, n: int) -> None:
        self._bind_table(n)
        pos, slots, kv_lens = self._placed(self.feed_start, n)
        self.logits0.copy_(self._forward(self.feed_ids[:n], pos, slots, kv_lens[-1:])[-1])

    def _chain_body(self, k: int, sampled: bool) -> None:
        if k > 1:  # the k - 1 fed tokens' positions, slots and lengths, computed once
            self._bind_table(1)
            pos, slots, kv_lens = self._placed(self.chain_start, k - 1)
        logits = self.logits0[None]  # [1, V]
        for i in range(k):
            tok = self._draw(logits, i, sampled)  # [1]
            if i == k - 1:
                break
            logits = self._forward(tok, pos[i : i + 1], slots[i : i + 1], kv_lens[i : i + 1])

    @contextlib.contextmanager
    def _context(self):
        """The model's attention through this module's paged backend (the eager drafter keeps its own attention)."""
        previous = self.model.attn_backend
        self.model.set_attention_backend(self.backend)
        try:
            yield
        finally:
            self.model.set_attention_backend(previous)

    # ---- replay ----------------------------------------------------------------------------------
    def fits(self, seq_len: int, k: int) -> bool:
        """Whether a chain of k after a sequence of seq_len tokens stays inside the window."""
        return 1 <= k <= self.k_max and seq_len + k - 1 <= self.window

    @torch.inference_mode()
    def draft(
        self,
        table: Sequence[int],  # the session's block table, covering positions < chain_start + k - 1
        chain_start: int,  # len(S): cache position of drafted token 0
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
        feed: tuple[np.ndarray, int] | None = None,  # (ids [n], start): tokens the cache lacks, fed by a feed graph
        logits0: torch.Tensor | None = None,  # [V] logits after the pending token, when the feed ran eagerly
    ) -> tuple[list[int], torch.Tensor | None]:  # k drafted ids, q [k, V] float32 (sampled) or None
        self._stage(table, chain_start, *(feed if feed is not None else (None, 0)))
        if feed is not None:
            self._run(("feed", len(feed[0])))
        else:
            self.logits0.copy_(logits0)
        return self._chain(k, sampling, generator)
