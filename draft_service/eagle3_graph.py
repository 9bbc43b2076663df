"""EAGLE-3 chains as CUDA graphs: the catch-up over the newly confirmed tokens in one replay, the k head passes of
the drafted chain in another, greedy or sampled, with no host read until the chain's tokens are needed.

The eager chain (eagle3.py `_draft_chain`) concatenates each drafted token's K/V onto the session's cache, so every
pass has a new shape. Here the passes work on fixed buffers instead:

- a window of P = W + max(k_max, 64) key slots (`keys`, `values` [P, Hkv, D]); slot e holds the entry of draft
  position e (sequence position e + 1); the slots past the confirmed ones take drafted entries (or a tree's fed
  nodes: eagle3_tree_graph.py, whose graphs run over this window after the same catch-up). The window remembers whose confirmed entries fill its first slots (`owner`): a session
  drafting again copies nothing in; another session's turn copies its ctx entries in (device to device);
- one pinned host-to-device copy per propose brings `args` = (keep, ctx, the catch-up's token ids): the confirmed
  entries still valid, the entries after the catch-up (ctx = keep + n; the pending token's draft position is
  ctx - 1, drafted token i + 1's is ctx + i) and the n confirmed tokens to feed;
- catch-up graph n (n = 1..k_max + 1, and 16, 32, .., 256 within the window): rows keep..keep+n-1 read cu_tokens /
  cu_feats, attend to the window's first `keep` slots plus each other causally, write their entries at those slots
  and leave the head output at the pending token in `out0`. A longer catch-up (the tokens of skipped steps, a
  prompt) runs as a few replays, the largest size that fits first (`long_piece`), so it never meets a new shape
  mid-request (eagerly, each new length was a first use); one past the window runs eagerly and `load` puts its
  result in the window;
  a drafting propose stages its catch-up and runs it with the chain in one replay ("block" graph (n, k, greedy |
  sampled), every one captured with the others when the drafter is built, so no request pays a capture);
- chain graph (k, greedy | sampled), k = 1..k_max: draws drafted token 1 from out0's logits, then k - 1 times
  feeds the last drawn token with the head's own output (pass i attends over the window with the mask
  `slot < ctx + i` plus its own key, Eagle3Head.step's layout, then writes its key and value at slot ctx + i).
  The k - 1 passes' positions, masks and RoPE tables are made once, before the first pass. Greedy: the argmax,
  mapped through d2t, exactly as the eager chain; sampled: a draw from the request's q (graph_sampling.py: its
  parameters and noise set before the replay), q kept for the target's verify.

Not captured (a CPU, or before capture()), the same bodies run eagerly over the same buffers: CPU tests check them
against the eager chain (greedy: token for token; sampled: q and the law of the draws).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.eagle3_head import Eagle3Head
from specserve.draft_service.eagle3_tree_graph import Eagle3TreeGraphs
from specserve.draft_service.graph_capture import GraphBodies, StagedBuffer
from specserve.draft_service.graph_sampling import GraphSampler

LONG_CATCH_UPS = (16, 32, 64, 128, 256)  # catch-up graph sizes past k_max + 1 (within the window)
TREE_SPARE_SLOTS = 64  # window slots past W for a tree's fed nodes ((depth - 1) * top_k of them)


class Eagle3ChainGraphs(GraphBodies):
    """Catch-up graphs for 1..k_max + 1 confirmed tokens and chain graphs for 1..k_max drafted tokens, greedy and
    sampled, sharing one set of static buffers and one memory pool."""

    def __init__(self, head: Eagle3Head, d2t: torch.Tensor, window: int, k_max: int) -> None:
        a = head.cfg.attention
        dev = head.fc.weight.device
        dtype = head.fc.weight.dtype
        self.head, self.d2t, self.window, self.k_max = head, d2t, window, k_max  # d2t [Vd] target id of each draft id
        super().__init__(dev)
        slots = window + max(k_max, TREE_SPARE_SLOTS)  # drafted entries (chains) or fed tree nodes past the window
        self.keys = torch.zeros(slots, a.num_kv_heads, a.head_dim, dtype=dtype, device=dev)  # [P, Hkv, D]
        self.values = torch.zeros_like(self.keys)
        n_max = k_max + 1  # the most confirmed tokens a catch-up + chain block feeds
        # longer catch-ups (skipped steps, a prompt) run as a few replays of these sizes (then one of <= n_max)
        self.long_sizes = tuple(b for b in LONG_CATCH_UPS if n_max < b <= window)
        n_max = max((n_max, *self.long_sizes))  # the most one catch-up graph feeds
        self._staged = StagedBuffer(2 + n_max, torch.int64, dev)
        self.args = self._staged.values  # [2 + n_max]
        self.keep = self.args[0]  # 0-dim: confirmed entries kept before the catch-up
        self.ctx = self.args[1]  # 0-dim: confirmed entries after it (the pending token's draft position + 1)
        self.cu_tokens = self.args[2:]  # [n_max] target ids of the confirmed tokens to feed
        self.cu_feats = torch.zeros(n_max, 3 * head.cfg.target_hidden_size, dtype=dtype, device=dev)  # [n_max, 3 Ht]
        self.out0 = torch.zeros(1, head.cfg.hidden_size, dtype=dtype, device=dev)  # head output at the pending token
        if head.cfg.vocab_size > 2**24:
            raise ValueError(
                f"vocab_size {head.cfg.vocab_size}: a sampled chain reads its ids back as float32 (<= 2^24)"
            )
        self.readback = torch.zeros(k_max + 1, dtype=torch.int64, device=dev)  # what a greedy propose reads: ...
        self.tokens = self.readback[:k_max]  # [k_max] drafted target ids, then
        self.rows_ok = self.readback[k_max:]  # [1] the rows check of the propose (session_state.py take_rows_check)
        self.sampler = GraphSampler(k_max, head.cfg.draft_vocab_size, dev)  # q over the draft vocabulary
        self._slot_ids = torch.arange(slots, device=dev)  # [P]
        self._rope = head.rope_rows(self._slot_ids, dtype)  # [P, 2, D] RoPE rows of every slot's position
        self.owner: object = None  # the session whose confirmed entries fill the window's first slots
        self.trees = Eagle3TreeGraphs(self, TREE_SPARE_SLOTS)  # whole trees over the same window (eagle3_tree_graph.py)

    # ---- what the graphs record (device ops only) ------------------------------------------------
    def _chain_body(self, k: int, sampled: bool) -> None:
        head = self.head
        if k > 1:  # the k - 1 fed tokens' positions (= their slots), biases and RoPE rows, made once
            pos = self.ctx + self._slot_ids[: k - 1]  # [k - 1]
            bias = head.window_bias(pos, self._slot_ids, self.out0.dtype, per_row=True)  # [k - 1, Hkv, G, P]
            rope = self._rope[pos]  # [k - 1, 2, D]
        out = self.out0
        for i in range(k):
            if sampled:
                draft_id = self.sampler.draw(head.logits(out), i, i + 1)  # [1]
            else:
                draft_id = head.greedy_ids(out)  # [1]
            torch.index_select(self.d2t, 0, draft_id, out=self.tokens[i : i + 1])  # its target id
            if i == k - 1:
                break
            out = head.window_step(
                head.embed(self.tokens[i : i + 1]),
                out,
                rope[i : i + 1],
                self.keys,
                self.values,
                pos[i : i + 1],
                bias[i],
            )

    def _catch_up_body(self, n: int) -> None:
        """Feed the n confirmed tokens in cu_tokens / cu_feats after the window's first `keep` entries."""
        pos = self.keep + self._slot_ids[:n]  # [n] draft positions == window slots
        head = self.head
        bias = head.window_bias(pos, self._slot_ids, self.out0.dtype, per_row=False)  # [Hkv, n * G, P]
        out = head.window_step(
            head.embed(self.cu_tokens[:n]),
            head.fuse(self.cu_feats[:n]),
            self._rope[pos],
            self.keys,
            self.values,
            pos,
            bias,
        )
        self.out0.copy_(out[n - 1 :])

    def _body(self, key: tuple) -> None:
        if key[0] == "catch_up":
            self._catch_up_body(key[1])
        elif key[0] == "block":  # ("block", n, k, sampled): the catch-up of n tokens, then the chain of k
            self._catch_up_body(key[1])
            self._chain_body(key[2], key[3])
        else:
            self._chain_body(key[1], key[2])

    def _keys(self) -> list[tuple]:
        """Every shape a chain propose replays, largest first: the catch-up + chain blocks (n, k) for every catch-up a
        verified chain leaves (n <= k_max + 1), the chains alone, the catch-ups alone."""
        blocks = [
            ("block", n, k, s)
            for k in range(self.k_max, 0, -1)
            for n in range(self.k_max + 1, 0, -1)
            for s in (True, False)
        ]
        chains = [("chain", k, s) for k in range(self.k_max, 0, -1) for s in (True, False)]
        catch_ups = [("catch_up", n) for n in (*reversed(self.long_sizes), *range(self.k_max + 1, 0, -1))]
        return blocks + chains + catch_ups

    # ---- capture and replay ----------------------------------------------------------------------
    def capture(self) -> None:
        super().capture()
        self.trees.capture()  # its graphs are captured per tree shape, on first use
        self.owner = None  # capture wrote scratch entries

    def fits(self, ctx: int, k: int) -> bool:
        return 1 <= k <= self.k_max and ctx <= self.window

    def catch_up_fits(self, keep: int, n: int) -> bool:
        return 1 <= n <= self.k_max + 1 and keep + n <= self.window

    def long_piece(self, keep: int, n: int) -> int:
        """How many of a catch-up's n > k_max + 1 tokens the next replay feeds (the largest long size < n, else
        k_max + 1: at least one token is left for the last replay, which may run with the chain), or 0 when the
        catch-up does not fit the window (it then runs eagerly)."""
        if keep + n > self.window:
            return 0
        return max((b for b in self.long_sizes if b < n), default=self.k_max + 1)

    def _stage(self, keep: int, ctx: int, tokens=()) -> None:
        """One pinned host-to-device copy of args (keep, ctx, catch-up tokens)."""
        h = self._staged.host()
        h[0], h[1] = keep, ctx
        h[2 : 2 + len(tokens)] = tokens
        self._staged.send()

    @torch.inference_mode()
    def catch_up(
        self,
        owner: object,  # the session (its identity says whether the window already holds its entries)
        keys: torch.Tensor,  # [>= keep, Hkv, D] the session's confirmed entries
        values: torch.Tensor,  # [>= keep, Hkv, D]
        keep: int,  # confirmed entries still valid
        tokens,  # n target ids (an int array): the confirmed tokens at draft positions keep .. keep + n - 1
        feats: torch.Tensor,  # [n, 3 * Ht] their target features
        run: bool = True,  # False: only stage it, for draft(catch_up=n) to run with the chain in one replay
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # out0 [H], new keys / values [n, Hkv, D] (window views)
        """One replay: the new entries land in the window (and are returned for the session's own cache); out0 and
        ctx are left for a chain replay."""
        n = len(tokens)
        if self.owner is not owner:
            self.keys[:keep].copy_(keys[:keep])
            self.values[:keep].copy_(values[:keep])
        self.owner = owner
        self._stage(keep, keep + n, tokens)
        self.cu_feats[:n].copy_(feats)
        if run:
            self._run(("catch_up", n))
        return self.out0[0], self.keys[keep : keep + n], self.values[keep : keep + n]

    @torch.inference_mode()
    def load(
        self,
        owner: object,
        keys: torch.Tensor,  # [ctx, Hkv, D] the session's confirmed entries (after an eager catch-up)
        values: torch.Tensor,  # [ctx, Hkv, D]
        out0: torch.Tensor,  # [H] head output at the pending token
    ) -> None:
        """The window, ctx and out0 of a session whose catch-up ran eagerly (or that another session displaced)."""
        ctx = keys.shape[0]
        self.keys[:ctx].copy_(keys)
        self.values[:ctx].copy_(values)
        self.out0.copy_(out0[None])
        self.owner = owner
        self._stage(ctx, ctx)

    @torch.inference_mode()
    def draft(
        self,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
        catch_up: int = 0,  # n > 0: the catch-up of n tokens staged by catch_up(run=False) runs first, same replay
        rows_check: torch.Tensor | None = None,  # 0-dim bool on the device (SessionState.take_rows_check), read back
    ) -> tuple[list[int], torch.Tensor | None, bool]:  # k drafted target ids, q [k, Vd] float32 on the host (sampled)
        # or None, whether rows_check held (True without one)
        """The chain after catch_up or load (window, ctx and out0 in place), or with the staged catch-up: one replay
        either way (the catch-up + chain graphs of every (n, k, greedy | sampled) are captured with the others), then
        one device read: the tokens and the rows check (greedy), or q with them (sampled)."""
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        if rows_check is not None:
            self.rows_ok.copy_(rows_check)
        self._run(("block", catch_up, k, sampled) if catch_up else ("chain", k, sampled))  # captured by capture()
        if not sampled:
            values = self.readback.tolist()  # the propose's one device read
            return values[:k], None, rows_check is None or values[-1] != 0
        q = self.sampler.q[:k]  # [k, Vd] float32
        host = torch.cat([q, self.tokens[:k, None].to(q.dtype), self.rows_ok.to(q.dtype).expand(k, 1)], dim=1).cpu()
        host = host.numpy()  # [k, Vd + 2]: q, the drafted ids (exact in float32), the rows check; the one device read
        return (
            host[:, -2].astype(np.int64).tolist(),
            torch.from_numpy(host[:, :-2]),
            rows_check is None or host[0, -1] != 0,
        )
