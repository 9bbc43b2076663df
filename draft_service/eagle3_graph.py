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

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every chain length (call before serving; the head's weights must not move afterwards)."""
        stream = torch.cuda.Stream(self.keys.device)
        stream.wait_stream(torch.cuda.current_stream(self.keys.device))
        with torch.cuda.stream(stream):
            for k in range(1, self.k_max + 1):
                self._passes(k)  # warm-up outside the capture
        torch.cuda.current_stream(self.keys.device).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for k in range(self.k_max, 0, -1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._passes(k)
            self._graphs[k] = graph
        torch.cuda.synchronize(self.keys.device)

    def fits(self, ctx: int, k: int) -> bool:
        return 1 <= k <= self.k_max and ctx <= self.window

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
        self.ctx.fill_(ctx)
        self.base.fill_(base)
        self.out0.copy_(out0[None])
        graph = self._graphs.get(k)
        if graph is not None:
            graph.replay()
        else:  # not captured (a CPU, or before capture): the same passes, eagerly, over the same buffers
            self._passes(k)
        return self.tokens[:k].tolist()  # the chain's one device read
