"""EAGLE-3 greedy chains as CUDA graphs: the k head passes of one drafted chain in one replay.

The eager chain (eagle3.py `_draft_chain`) concatenates each drafted token's K/V onto the session's cache, so every
pass has a new shape. Here the passes work on fixed buffers instead:

- a window of W + k_max key slots (`keys`, `values` [W + k_max, Hkv, D]); before a replay the session's confirmed
  entries are copied into its first `ctx` slots (a device-to-device copy of ctx x Hkv x D values);
- pass i attends over the whole window with the mask `slot < ctx + i` plus its own new key (Eagle3Head.step's
  mask layout), then writes its key and value at slot ctx + i, so the next pass sees them;
- ctx and the pending token's draft position live in device scalars, set by fill_ (no host synchronisation).

Greedy only: a sampled chain draws from per-request generators, which run eagerly. Drafted tokens are the argmax of
the head's logits mapped through d2t, exactly as the eager chain computes them (tests compare the two).

Catch-up (feeding the n tokens the target confirmed since the last draft, with their target features) is one graph
per n = 1..k_max + 1 over the same window: rows keep..keep+n-1 attend to the window's first `keep` slots plus each
other causally, write their entries at those slots, and leave the head output at the pending token in `out0` and
`ctx` = keep + n, so a chain replay can follow with no host work in between. The window remembers whose confirmed
entries it holds (`owner`), so a session drafting again does not copy its cache in again.
"""

from __future__ import annotations

import torch

from specserve.draft_service.eagle3_head import Eagle3Head


class Eagle3ChainGraphs:
    """One captured graph per chain length 1..k_max, sharing one set of static buffers."""

    def __init__(self, head: Eagle3Head, d2t: torch.Tensor, window: int, k_max: int) -> None:
        a = head.cfg.attention
        dev = head.fc.weight.device
        dtype = head.fc.weight.dtype
        self.head, self.d2t, self.window, self.k_max = head, d2t, window, k_max
        slots = window + k_max
        self.keys = torch.zeros(slots, a.num_kv_heads, a.head_dim, dtype=dtype, device=dev)  # [W + k_max, Hkv, D]
        self.values = torch.zeros_like(self.keys)
        self.ctx = torch.zeros((), dtype=torch.int64, device=dev)  # confirmed entries in the window
        self.base = torch.zeros((), dtype=torch.int64, device=dev)  # draft position of the pending token
        self.out0 = torch.zeros(1, head.cfg.hidden_size, dtype=dtype, device=dev)  # head output at the pending token
        self.tokens = torch.zeros(k_max, dtype=torch.int64, device=dev)  # drafted target ids
        self._slot_ids = torch.arange(slots, device=dev)  # [W + k_max]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}  # empty until capture(): draft() then runs the passes
        # catch-up inputs: up to k_max + 1 confirmed tokens (target ids) and their target features
        n_max = k_max + 1
        self.keep = torch.zeros((), dtype=torch.int64, device=dev)  # confirmed entries kept before the catch-up
        self.cu_tokens = torch.zeros(n_max, dtype=torch.int64, device=dev)  # [k_max + 1]
        self.cu_feats = torch.zeros(n_max, 3 * head.cfg.target_hidden_size, dtype=dtype, device=dev)
        self._cu_staging = torch.zeros(n_max, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._causal = torch.ones(n_max, n_max, dtype=torch.bool, device=dev).tril()  # [n_max, n_max]
        self._catch_up_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.owner: object = None  # the session whose confirmed entries fill the window's first slots

    def _passes(self, k: int) -> None:
        """The k head passes over the static buffers (what a graph records)."""
        out = self.out0
        logits = self.head.logits(out)  # [1, Vd]
        for i in range(k):
            target_id = self.d2t[logits.argmax(dim=-1)]  # [1]
            self.tokens[i : i + 1].copy_(target_id)
            if i == k - 1:
                break
            visible = self._slot_ids < self.ctx + i  # [W + k_max]: confirmed entries and earlier drafts
            mask = torch.cat([visible, visible.new_ones(1)])[None]  # [1, W + k_max + 1] (own key last)
            pos = (self.base + 1 + i).reshape(1)
            out, key, value = self.head.step(self.head.embed(target_id), out, pos, self.keys, self.values, mask)
            slot = (self.ctx + i).reshape(1)
            self.keys.index_copy_(0, slot, key)
            self.values.index_copy_(0, slot, value)
            logits = self.head.logits(out)

    def _catch_up_pass(self, n: int) -> None:
        """Feed the n confirmed tokens in cu_tokens / cu_feats after the window's first `keep` entries."""
        pos = self.keep + self._slot_ids[:n]  # [n] draft positions == window slots
        visible = (self._slot_ids < self.keep)[None].expand(n, -1)  # [n, W + k_max]
        mask = torch.cat([visible, self._causal[:n, :n]], dim=1)  # [n, W + k_max + n]
        tokens = self.cu_tokens[:n]
        out, key, value = self.head.step(self.head.embed(tokens), self.head.fuse(self.cu_feats[:n]), pos,
                                         self.keys, self.values, mask)
        self.keys.index_copy_(0, pos, key)
        self.values.index_copy_(0, pos, value)
        self.out0.copy_(out[n - 1:])
        self.ctx.copy_(self.keep + n)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every chain length and catch-up size (call before serving; the head's weights must not move)."""
        dev = self.keys.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for k in range(1, self.k_max + 1):
                self._passes(k)  # warm-up outside the capture
            for n in range(1, self.k_max + 2):
                self._catch_up_pass(n)
        torch.cuda.current_stream(dev).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for k in range(self.k_max, 0, -1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._passes(k)
            self._graphs[k] = graph
        for n in range(self.k_max + 1, 0, -1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._catch_up_pass(n)
            self._catch_up_graphs[n] = graph
        self.owner = None  # capture wrote scratch entries
        torch.cuda.synchronize(dev)

    def fits(self, ctx: int, k: int) -> bool:
        return 1 <= k <= self.k_max and ctx <= self.window

    def catch_up_fits(self, keep: int, n: int) -> bool:
        return 1 <= n <= self.k_max + 1 and keep + n <= self.window

    @torch.inference_mode()
    def catch_up(
        self,
        owner: object,  # the session (its identity says whether the window already holds its entries)
        keys: torch.Tensor,  # [>= keep, Hkv, D] the session's confirmed entries
        values: torch.Tensor,  # [>= keep, Hkv, D]
        keep: int,  # confirmed entries still valid
        tokens,  # n target ids: the confirmed tokens at draft positions keep .. keep + n - 1
        feats: torch.Tensor,  # [n, 3 * Ht] their target features
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out0 [H], new keys / values [n, Hkv, D] (views)
        """One replay: the new entries land in the window (and are returned for the session's own cache); out0 and
        ctx are left for a chain replay."""
        n = len(tokens)
        if self.owner is not owner:
            self.keys[:keep].copy_(keys[:keep])
            self.values[:keep].copy_(values[:keep])
        self.owner = owner
        self.keep.fill_(keep)
        staged = self._cu_staging[:n]
        staged.numpy()[:] = tokens
        self.cu_tokens[:n].copy_(staged, non_blocking=True)
        self.cu_feats[:n].copy_(feats)
        graph = self._catch_up_graphs.get(n)
        if graph is not None:
            graph.replay()
        else:
            self._catch_up_pass(n)
        return self.out0[0], self.keys[keep: keep + n], self.values[keep: keep + n]

    @torch.inference_mode()
    def draft_from_window(self, base: int, k: int) -> list[int]:  # k drafted target ids
        """The chain after catch_up (window, ctx and out0 already set)."""
        self.base.fill_(base)
        graph = self._graphs.get(k)
        if graph is not None:
            graph.replay()
        else:
            self._passes(k)
        return self.tokens[:k].tolist()  # the chain's one device read

    @torch.inference_mode()
    def draft(
        self,
        out0: torch.Tensor,  # [H] head output at the pending token
        keys: torch.Tensor,  # [ctx, Hkv, D] the session's confirmed entries
        values: torch.Tensor,  # [ctx, Hkv, D]
        base: int,  # draft position of the pending token
        k: int,
    ) -> list[int]:  # k drafted target ids
        ctx = keys.shape[0]
        self.keys[:ctx].copy_(keys)
        self.values[:ctx].copy_(values)
        self.owner = None  # drafts leave entries past ctx; the next catch-up copies its session's entries in
        self.ctx.fill_(ctx)
        self.base.fill_(base)
        self.out0.copy_(out0[None])
        graph = self._graphs.get(k)
        if graph is not None:
            graph.replay()
        else:  # not captured (a CPU, or before capture): the same passes, eagerly, over the same buffers
            self._passes(k)
        return self.tokens[:k].tolist()  # the chain's one device read
