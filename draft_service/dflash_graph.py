"""DFlash blocks as CUDA graphs (dflash.py): the context K/V of the newly confirmed rows in one replay, every denoising
pass of the drafted block in another, with no host read until the block's tokens are needed.

The eager proposer attends over the session's context K/V as they are ([P, Hkv, D] per layer, P = its confirmed
positions), so every block has new shapes. Here the passes work on fixed buffers instead:

- per draft layer a window of W context rows (`keys`, `values` [W, Hkv, D]). The window remembers whose rows it
  holds (`load`): a session drafting again copies only the rows it lacks (none, when its last propose ran here),
  another session's turn copies its P rows in (device to device);
- one pinned host-to-device copy per propose (`stage`) brings `args` = (ctx, the pending token, its position, keep):
  the context rows after this propose's extension, the block's first token, and the rows kept before it;
- extend graph n (n = 1..k_max + 1): the context K/V of the n rows the target confirmed since the last propose
  (DFlashModel.context_kv of their target features in `feats`, at positions keep..keep+n-1), written at those window
  rows; the proposer copies them into the session's own cache. A longer extension (a prompt) runs eagerly and
  `load` copies its rows in;
- block graph (k, greedy | sampled), k = 1..k_max: each pass is DFlashModel.block_logits over the whole window with
  the context mask `row < ctx`, the tokens fixed by earlier passes read in place from `tokens`; it runs the
  min(denoise_steps, k) passes of a k-token block, as the eager proposer does: each pass but the last fixes one more
  token, the last fixes the rest. Greedy: the argmax; sampled: a draw from each row's q (graph_sampling.py), q kept
  for the target's verify.

Not captured (a CPU, or before capture()), the same bodies run eagerly over the same buffers: CPU tests check them.
"""

from __future__ import annotations

import weakref

import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_capture import GraphBodies, StagedBuffer
from specserve.draft_service.graph_sampling import GraphSampler


class DFlashBlockGraphs(GraphBodies):
    """Extend graphs for 1..k_max + 1 new context rows and block graphs for 1..k_max drafted tokens, greedy and
    sampled, sharing one set of static buffers and one memory pool."""

    def __init__(self, model, window: int, k_max: int, passes: int) -> None:
        c = model.cfg
        dev, dtype = model.fc.weight.device, model.fc.weight.dtype
        self.model, self.window, self.k_max, self.passes = model, window, k_max, passes
        super().__init__(dev)
        shape = (window, c.num_key_value_heads, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.num_hidden_layers)]  # [W, Hkv, D]
        self.values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.num_hidden_layers)]
        self._staged = StagedBuffer(4, torch.int64, dev)
        self.args = self._staged.values  # [4] ctx, pending token, its position, keep
        self.ctx = self.args[0]  # 0-dim: context rows in the window (P)
        self.first = self.args[1:2]  # [1] the pending token
        self.first_pos = self.args[2]  # 0-dim: its position
        self.keep = self.args[3]  # 0-dim: rows kept before this propose's extension
        self.n_max = k_max + 1  # the most new rows one extend graph computes (accepted tokens + the old pending one)
        self.feats = torch.zeros(self.n_max, len(c.target_layer_ids) * c.target_hidden_size, dtype=dtype, device=dev)
        self.tokens = torch.zeros(k_max, dtype=torch.int64, device=dev)  # [k_max] drafted ids
        self.sampler = GraphSampler(k_max, c.vocab_size, dev)
        self._rows = torch.arange(window, device=dev)  # [W]
        self._owner = None  # weak reference to the session state whose rows the window holds

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _block_body(self, k: int, sampled: bool) -> None:
        """The passes of one k-token block over the static buffers."""
        b = self.model.cfg.block_size
        ctx_mask = (self._rows < self.ctx)[None].expand(b, self.window)  # [b, W]
        kv = list(zip(self.keys, self.values))
        passes, fixed = min(self.passes, k), 0
        for step in range(passes):
            logits = self.model.block_logits(
                self.first, self.first_pos, kv, ctx_mask=ctx_mask, given=self.tokens[:fixed]
            )  # [drafts_per_block, V]
            end = fixed + 1 if step < passes - 1 else k
            rows = logits[fixed:end]
            tok = self.sampler.draw(rows, fixed, end) if sampled else rows.argmax(dim=-1)  # [end - fixed]
            self.tokens[fixed:end].copy_(tok)
            fixed = end

    def _extend_body(self, n: int) -> None:
        """The context K/V of the n rows in feats, at positions (= window rows) keep..keep+n-1."""
        pos = self.keep + self._rows[:n]  # [n]
        for (k, v), keys, values in zip(self.model.context_kv(self.feats[:n], pos), self.keys, self.values):
            keys.index_copy_(0, pos, k)
            values.index_copy_(0, pos, v)

    def _body(self, key: tuple) -> None:
        if key[0] == "extend":
            self._extend_body(key[1])
        else:
            self._block_body(key[1], key[2])

    def _keys(self) -> list[tuple]:
        blocks = [("block", k, s) for k in range(self.k_max, 0, -1) for s in (True, False)]
        return blocks + [("extend", n) for n in range(self.n_max, 0, -1)]

    # ---- capture and replay ----------------------------------------------------------------------
    def capture(self) -> None:
        super().capture()
        self._owner = None  # the warm-up wrote scratch rows

    def fits(self, ctx: int, k: int) -> bool:
        return 1 <= k <= self.k_max and ctx <= self.window

    def extends(self, n: int) -> bool:
        return 1 <= n <= self.n_max

    @torch.inference_mode()
    def load(
        self,
        session: object,  # the session's state object (the window remembers whose rows it holds)
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer the session's context K/V, each [>= upto, Hkv, D]
        same_rows: int,  # rows [0, same_rows) of kv are unchanged since the window last held this session's rows
        upto: int,  # the window's rows [0, upto) become the session's
    ) -> None:
        start = min(same_rows, upto) if self._owner is not None and self._owner() is session else 0
        for (k_rows, v_rows), keys, values in zip(kv, self.keys, self.values):
            keys[start:upto].copy_(k_rows[start:upto])
            values[start:upto].copy_(v_rows[start:upto])
        self._owner = weakref.ref(session)

    def stage(self, keep: int, ctx: int, first_token: int) -> None:
        """One pinned host-to-device copy: ctx, the pending token (at position ctx) and keep."""
        self._staged.host()[:] = (ctx, first_token, ctx, keep)
        self._staged.send()

    @torch.inference_mode()
    def extend(self, keep: int, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:  # feats [n, F]
        """After load(upto=keep) and stage(keep, ...): the n new rows' K/V, one replay; returns them (window views, per
        layer ([n, Hkv, D], [n, Hkv, D])) for the session's own cache."""
        n = feats.shape[0]
        self.feats[:n].copy_(feats)
        self._run(("extend", n))
        return [(keys[keep : keep + n], values[keep : keep + n]) for keys, values in zip(self.keys, self.values)]

    @torch.inference_mode()
    def draft(
        self,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
    ) -> tuple[list[int], torch.Tensor | None]:  # k drafted ids, q [k, V] float32 (sampled) or None
        """The block after stage (and load / extend: the window holds the session's ctx rows)."""
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        self._run(("block", k, sampled))
        tokens = self.tokens[:k].tolist()  # the block's one device read (q follows it)
        return tokens, (self.sampler.q[:k].clone() if sampled else None)
