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
chain's tokens (and q) are read once. A feed too long for the feed graphs (a prompt) runs eagerly and its output is
copied into `out0`. Not captured (a CPU, or before capture()), the same bodies run eagerly over the same buffers: CPU
tests compare them with the eager chain. Graphs are captured before any session holds blocks (warm-up and capture
write scratch entries into block 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_capture import capture_or_record
from specserve.draft_service.graph_sampling import GraphSampler
from specserve.models.attn_metadata import AttentionBatch
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


class MTPChainGraphs:
    """Feed graphs for 1..feed_max entries and chain graphs for 1..k_max drafted tokens, greedy and sampled, sharing
    one set of static buffers and one memory pool."""

    def __init__(self, layer, kv: PagedKVCache, block_size: int, window: int, vocab: int, k_max: int,
                 feed_max: int, attention: str = "paged_torch") -> None:  # attention: "triton_paged" | "paged_torch"
        dev = kv.device
        self.layer, self.kv, self.block_size, self.vocab = layer, kv, block_size, vocab
        self.k_max, self.feed_max, self.device, self.attention = k_max, feed_max, dev, attention
        self.num_blocks = max(1, window // block_size)  # NB: the attention window in blocks
        self.window = self.num_blocks * block_size  # entries a chain may reach
        self.backend = _backend(attention, layer.block.self_attn, block_size, dev)
        self.experts_fn = graph_experts_fn(dev, kv.dtype)
        n_args = 2 + feed_max + self.num_blocks
        self.args = torch.zeros(n_args, dtype=torch.int64, device=dev)  # [2 + feed_max + NB]
        self.feed_start = self.args[0]  # 0-dim: the feed's first entry
        self.chain_base = self.args[1]  # 0-dim: the pending token's entry (drafted token i + 2 is entry base + 1 + i)
        self.feed_ids = self.args[2: 2 + feed_max]  # [feed_max] the token each fed entry reads
        self.table = self.args[2 + feed_max:]  # [NB] the session's block table, zero-padded
        self._host = torch.zeros(n_args, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        hidden = layer.config.hidden_size
        self.rows = torch.zeros(feed_max, hidden, dtype=kv.dtype, device=dev)  # [feed_max, H] the feed's target rows
        self.out0 = torch.zeros(1, hidden, dtype=kv.dtype, device=dev)  # [1, H] the block's output at the pending token
        self.tokens = torch.zeros(k_max, dtype=torch.int64, device=dev)  # [k_max] drafted ids
        self.sampler = GraphSampler(k_max, vocab, dev)
        self._arange = torch.arange(max(feed_max, k_max, 1), dtype=torch.int64, device=dev)
        self._steps = {t: self._new_step(t) for t in range(1, max(feed_max, 1) + 1)}  # the backend's step per size
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # empty until capture(): bodies then run eagerly
        self.capture_errors: dict[tuple, str] = {}  # graph key -> why it was not captured

    def _new_step(self, t: int):
        from specserve.kernels.attention import GraphShape

        step = self.backend.new_graph_step(GraphShape((t,), False, self.window))
        if self.attention == "triton_paged":  # rows 0..t-1 of request 0, causal among themselves
            step.rows.row_index.copy_(torch.arange(t))
        else:
            step.new_mask.copy_(torch.ones(t, t, dtype=torch.bool).tril())  # row_request stays 0 (one request)
        return step

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _entries(self, start: torch.Tensor, n: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries start..start+n-1 (start: 0-dim) for forwards of t tokens: (positions [n], cache slots [n], kv
        lengths [n] = position + 1); the session's table bound into the t-token step."""
        step = self._steps[t]
        (step.rows.block_tables if self.attention == "triton_paged" else step.block_tables)[0].copy_(self.table)
        pos = start + self._arange[:n]
        slots = self.table.gather(0, pos // self.block_size) * self.block_size + pos % self.block_size
        return pos, slots, pos + 1

    def _step(self, tokens: torch.Tensor, previous: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
              kv_len: torch.Tensor) -> torch.Tensor:
        """tokens [T] at consecutive entries pos [T] (slots [T], kv_len [1] = pos[-1] + 1) -> the block's output [T, H]."""
        t = tokens.shape[0]
        step = self._steps[t]
        if self.attention == "triton_paged":
            step.rows.kv_lens.copy_(kv_len)  # cached + new (int32)
            step.rows.new_starts.copy_(pos[:1])
        else:
            step.context_lens.copy_(pos[:1])
        # a fresh batch object per forward: its slot_mapping is this forward's slots; its host lengths are unused
        attn = AttentionBatch(query_lens=(t,), context_lens=(0,), block_tables=((0,),), slot_mapping=slots,
                              tree_masks=(None,))
        self.backend.bind(attn, step)
        return self.layer.step(tokens, previous, pos, attn, self.kv)

    def _feed_body(self, n: int) -> None:
        pos, slots, kv_lens = self._entries(self.feed_start, n, n)
        out = self._step(self.feed_ids[:n], self.layer.target_norm(self.rows[:n]), pos, slots, kv_lens[-1:])
        self.out0.copy_(out[n - 1:])

    def _chain_body(self, k: int, sampled: bool) -> None:
        if k > 1:  # the k - 1 chained entries' positions, slots and lengths, computed once
            pos, slots, kv_lens = self._entries(self.chain_base + 1, k - 1, 1)
        h = self.out0
        logits = self.layer.logits(h)  # [1, V]
        for i in range(k):
            tok = self.sampler.draw(logits, i, i + 1) if sampled else logits.argmax(dim=-1)  # [1]
            self.tokens[i: i + 1].copy_(tok)
            if i == k - 1:
                break
            h = self._step(tok, h, pos[i: i + 1], slots[i: i + 1], kv_lens[i: i + 1])
            logits = self.layer.logits(h)

    def _body(self, key: tuple) -> None:
        if key[0] == "feed":
            self._feed_body(key[1])
        else:
            self._chain_body(key[1], key[2])

    @contextlib.contextmanager
    def _graph_safe(self):
        """The layer's attention through this module's paged backend and its experts through `experts_fn` (the eager
        drafter keeps the torch attention and the MoE reference)."""
        attn, mlp = self.layer.block.self_attn, self.layer.block.mlp
        previous = attn.attn_backend, getattr(mlp, "experts_fn", None)
        attn.attn_backend = self.backend
        if self.layer.block.is_moe:
            mlp.experts_fn = self.experts_fn
        try:
            yield
        finally:
            attn.attn_backend = previous[0]
            if self.layer.block.is_moe:
                mlp.experts_fn = previous[1]

    def _keys(self) -> list[tuple]:
        feeds = [("feed", n) for n in range(self.feed_max, 0, -1)]
        return feeds + [("chain", k, s) for k in range(self.k_max, 0, -1) for s in (True, False)]

    # ---- capture and replay ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every feed and chain graph (before any session holds blocks; the weights must not move after)."""
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with self._graph_safe(), torch.cuda.stream(stream):
            for key in self._keys():  # warm-up outside the capture (cuBLAS handles, Triton compiles, allocator)
                self._body(key)
        torch.cuda.current_stream(dev).wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        with self._graph_safe():
            for key in self._keys():
                capture_or_record(type(self).__name__, key, lambda key=key: self._body(key), pool, self._graphs,
                                  self.capture_errors)
        torch.cuda.synchronize(dev)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def fits(self, seq_len: int, k: int) -> bool:
        """Whether a chain of k after a sequence of seq_len tokens (entries up to seq_len + k - 3) stays in the window."""
        return 1 <= k <= self.k_max and seq_len + k - 2 <= self.window

    def feeds(self, n: int) -> bool:
        return 1 <= n <= self.feed_max

    def _run(self, key: tuple) -> None:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            with self._graph_safe():
                self._body(key)

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
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the staging buffer has run
        h = self._host
        h.zero_()
        h[1] = base
        if feed is not None:
            ids, rows, start = feed
            h[0] = start
            h[2: 2 + len(ids)] = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
            self.rows[: len(ids)].copy_(rows)
        h[2 + self.feed_max: 2 + self.feed_max + len(table)] = torch.tensor(table, dtype=torch.int64)
        self.args.copy_(h, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        if feed is not None:
            self._run(("feed", len(feed[0])))
        else:
            self.out0.copy_(out0[None])
        self._run(("chain", k, sampled))
        tokens = self.tokens[:k].tolist()  # the propose's one device read (q follows it)
        return tokens, (self.sampler.q[:k].clone() if sampled else None)


def _backend(kind: str, attn_module, block_size: int, device: torch.device):
    if kind == "triton_paged":
        from specserve.models.triton_paged_attention import TritonPagedBackend

        return TritonPagedBackend(attn_module, block_size, device)
    from specserve.models.paged_torch_attention import PagedTorchBackend

    return PagedTorchBackend(attn_module, block_size, device)
