"""DFlash blocks as CUDA graphs (dflash.py): every denoising pass of one drafted block in one replay.

The eager proposer attends over the session's context K/V as they are ([P, Hkv, D] per layer, P = its confirmed
positions), so every block has new shapes. Here the passes work on fixed buffers instead:

- per draft layer a window of W context rows (`keys`, `values` [W, Hkv, D]); before a replay the rows the window
  lacks are copied in from the session's K/V (device to device: only the rows past what it already holds, when the
  window still holds this session's, else all P rows);
- each pass is DFlashModel.block_logits over the whole window with the context mask `row < ctx` (ctx, the pending
  token and its position live in device scalars), the tokens fixed by earlier passes read in place from `tokens`;
- graph k (k = 1..k_max, greedy | sampled) runs the min(denoise_steps, k) passes of a k-token block, as the eager
  proposer does: each pass but the last fixes one more token, the last fixes the rest. Greedy: the argmax; sampled: a
  draw from each row's q (graph_sampling.py), q kept for the target's verify.

Not captured (a CPU, or before capture()), the same passes run eagerly over the same buffers: CPU tests check them.
"""

from __future__ import annotations

import weakref

import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_capture import capture_or_record
from specserve.draft_service.graph_sampling import GraphSampler


class DFlashBlockGraphs:
    """One captured graph per (block length, greedy | sampled), sharing one set of static buffers."""

    def __init__(self, model, window: int, k_max: int, passes: int) -> None:
        c = model.cfg
        dev, dtype = model.fc.weight.device, model.fc.weight.dtype
        self.model, self.window, self.k_max, self.passes = model, window, k_max, passes
        self.device = dev
        shape = (window, c.num_key_value_heads, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.num_hidden_layers)]  # [W, Hkv, D]
        self.values = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(c.num_hidden_layers)]
        self.args = torch.zeros(3, dtype=torch.int64, device=dev)  # [3] ctx, pending token, its position
        self.ctx = self.args[0]  # 0-dim: context rows in the window (P)
        self.first = self.args[1:2]  # [1] the pending token
        self.first_pos = self.args[2]  # 0-dim: its position
        self._host = torch.zeros(3, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.tokens = torch.zeros(k_max, dtype=torch.int64, device=dev)  # [k_max] drafted ids
        self.sampler = GraphSampler(k_max, c.vocab_size, dev)
        self._rows = torch.arange(window, device=dev)  # [W]
        self._owner = None  # weak reference to the session state whose rows the window holds
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.capture_errors: dict[tuple, str] = {}  # graph key -> why it was not captured

    def _passes(self, k: int, sampled: bool) -> None:
        """The passes of one k-token block over the static buffers (what a graph records)."""
        b = self.model.cfg.block_size
        ctx_mask = (self._rows < self.ctx)[None].expand(b, self.window)  # [b, W]
        kv = list(zip(self.keys, self.values))
        passes, fixed = min(self.passes, k), 0
        for step in range(passes):
            logits = self.model.block_logits(self.first, self.first_pos, kv, ctx_mask=ctx_mask,
                                             given=self.tokens[:fixed])  # [drafts_per_block, V]
            end = fixed + 1 if step < passes - 1 else k
            rows = logits[fixed:end]
            tok = self.sampler.draw(rows, fixed, end) if sampled else rows.argmax(dim=-1)  # [end - fixed]
            self.tokens[fixed:end].copy_(tok)
            fixed = end

    def _keys(self) -> list[tuple[int, bool]]:
        return [(k, s) for k in range(self.k_max, 0, -1) for s in (True, False)]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every block length, greedy and sampled (call before serving; the weights must not move after)."""
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for key in self._keys():  # warm-up outside the capture
                self._passes(*key)
        torch.cuda.current_stream(dev).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for key in self._keys():
            self._capture_one(key, pool)
        torch.cuda.synchronize(dev)

    def _capture_one(self, key: tuple, pool) -> None:
        """One graph; a shape that fails to capture runs its body eagerly (over the same buffers) and says why."""
        capture_or_record(type(self).__name__, key, lambda: self._passes(*key), pool, self._graphs, self.capture_errors)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def fits(self, ctx: int, k: int) -> bool:
        return 1 <= k <= self.k_max and ctx <= self.window

    @torch.inference_mode()
    def draft(
        self,
        session: object,  # the session's state object (the window remembers whose rows it holds)
        kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer the session's context K/V, each [P, Hkv, D]
        same_rows: int,  # rows [0, same_rows) of kv are unchanged since this session's last draft()
        first_token: int,  # the pending token
        first_pos: int,  # its position
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
    ) -> tuple[list[int], torch.Tensor | None]:  # k drafted ids, q [k, V] float32 (sampled) or None
        ctx = kv[0][0].shape[0]
        start = min(same_rows, ctx) if self._owner is not None and self._owner() is session else 0
        for (k_rows, v_rows), keys, values in zip(kv, self.keys, self.values):
            keys[start:ctx].copy_(k_rows[start:ctx])
            values[start:ctx].copy_(v_rows[start:ctx])
        self._owner = weakref.ref(session)
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffer has run
        self._host.copy_(torch.tensor([ctx, first_token, first_pos], dtype=torch.int64))
        self.args.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        graph = self._graphs.get((k, sampled))
        if graph is not None:
            graph.replay()
        else:
            self._passes(k, sampled)
        tokens = self.tokens[:k].tolist()  # the block's one device read (q follows it)
        return tokens, (self.sampler.q[:k].clone() if sampled else None)
