"""EAGLE-3 trees as CUDA graphs: the whole EAGLE-2 dynamic tree of one propose (tree.py's rules) in one replay, greedy
or sampled, over the chain graphs' window (eagle3_graph.py: the catch-up replay leaves the session's confirmed
entries, ctx and the head output at the pending token there), with one device read of the kept nodes at the end.

tree.py builds the tree on the host, node by node. Here every level has a fixed shape: level 1 is the top_k children
of the pending token, each later level the top_k children of each of the top_k best nodes of the level before
(N = K + (D - 1) K^2 nodes for K = top_k, D = depth), so the builder's choices become device ops:

- the nodes a level expands: a stable descending sort of the level's cumulative log-probabilities (ties in node
  order, as tree.py's key (-cum, id)), the first K, in node order;
- they are fed in one head pass (their tokens, their parents' head outputs; the pending token's for level 1) at
  draft position ctx - 1 + depth, each attending to the confirmed entries and to its fed ancestors (a mask from each
  node's ancestor set), their entries written at window slots ctx + f (f = the order they are fed in, as tree.py's
  `fed` list);
- children, greedy: the top_k of the log-softmax, cumulative log-probabilities in float64 (tree.py adds Python
  floats), score = cum; sampled: top_k draws without replacement from q (graph_sampling's transform) as the order of
  q / E for Exp(1) noise E (an exponential race is a draw without replacement), sibling j declaring q with siblings
  0..j-1 removed and renormalised, score = the parent's cum; a draw beyond q's support is an invalid node (-inf),
  never expanded into valid ones and never kept;
- the final cut: a stable descending sort of the scores (ties by depth, then id: node order), the first num_nodes,
  in node order, parents renumbered.

`result` then holds (kept count, their target ids, their parents) and `q` the kept nodes' declared rows: one read.
Graphs are captured per (num_nodes, top_k, depth, greedy | sampled) on first use (a request picks its tree), up to
MAX_TREE_GRAPHS; others, and trees whose fed nodes do not fit the window's spare slots, run the same body eagerly.
Not captured (a CPU), the body runs eagerly over the same buffers: CPU tests check it against tree.py's builder.
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.graph_capture import GraphBodies
from specserve.draft_service.graph_sampling import GraphSampler

MAX_TREE_GRAPHS = 8  # distinct tree shapes captured per drafter


def tree_nodes(spec: TreeSpec) -> int:
    """N: nodes of the full tree of `spec` (before the final cut)."""
    return spec.top_k + (spec.depth - 1) * spec.top_k**2


class Eagle3TreeGraphs(GraphBodies):
    """Tree bodies over an Eagle3ChainGraphs' window (its keys, values, ctx, out0 and d2t)."""

    def __init__(self, chain, spare_slots: int) -> None:  # chain: Eagle3ChainGraphs; spare_slots: past its W
        super().__init__(chain.device)
        self.chain, self.spare_slots = chain, spare_slots
        self.sampler = GraphSampler(1 + spare_slots, chain.head.cfg.draft_vocab_size, chain.device)
        self._outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (result [1 + 2M], q [M, Vd])

    def _keys(self) -> list[tuple]:
        return []  # shapes come with requests: _capture_late

    def fits(self, ctx: int, spec: TreeSpec) -> bool:
        c = self.chain
        return (
            ctx <= c.window
            and (spec.depth - 1) * spec.top_k <= self.spare_slots
            and spec.top_k <= c.head.cfg.draft_vocab_size
        )

    def _out(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._outputs:
            m = min(key[1], tree_nodes(TreeSpec(key[1], key[2], key[3])))
            self._outputs[key] = (
                torch.zeros(1 + 2 * m, dtype=torch.int64, device=self.device),
                torch.zeros(m, self.chain.head.cfg.draft_vocab_size, device=self.device),
            )
        return self._outputs[key]

    # ---- what a graph records (device ops only) --------------------------------------------------
    def _children(self, logits, parent_cum, parent_valid, k: int, noise) -> tuple:
        """Each row's k children: (draft ids [R, k], cum [R, k] float64, score [R, k] float64, valid [R, k],
        declared q [R, k, Vd] or None); invalid ones score -inf."""
        if noise is None:  # greedy: tree.py's top_k of the log-softmax
            top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
            cum = parent_cum[:, None] + top.values.double()
            valid = parent_valid[:, None].expand_as(cum)
            return top.indices, cum, cum.masked_fill(~valid, float("-inf")), valid, None
        q = self.sampler.probs(logits)  # [R, Vd]
        tok = (q / noise).topk(k, dim=-1).indices  # [R, k] in draw order
        qt = q.gather(1, tok)  # [R, k]
        valid = (qt > 0) & parent_valid[:, None]
        cum = (parent_cum[:, None] + torch.log(qt).double()).masked_fill(~valid, float("-inf"))
        score = parent_cum[:, None].expand_as(cum).masked_fill(~valid, float("-inf"))
        drawn = torch.zeros(*tok.shape, q.shape[-1], device=q.device).scatter_(2, tok[..., None], 1.0)  # [R, k, Vd]
        remaining = q[:, None] * (1.0 - (drawn.cumsum(1) - drawn))  # earlier siblings removed
        declared = remaining / remaining.sum(-1, keepdim=True).clamp_min(1e-30)
        return tok, cum, score, valid, declared

    def _body(self, key: tuple) -> None:
        _, num_nodes, k, depth, sampled = key
        c, head = self.chain, self.chain.head
        dev, big_f = self.device, (depth - 1) * k  # fed nodes
        ctx = c.ctx
        noise = self.sampler.noise if sampled else None
        out0 = c.out0  # [1, H]
        root = self._children(
            head.logits(out0),
            torch.zeros(1, dtype=torch.float64, device=dev),
            torch.ones(1, dtype=torch.bool, device=dev),
            k,
            None if noise is None else noise[:1],
        )
        tok, cum, score, valid = (t.reshape(-1) for t in root[:4])  # [K] each: level 1
        declared = [root[4].reshape(k, -1)] if sampled else []
        parent = torch.full((k,), -1, dtype=torch.int64, device=dev)
        pslot = torch.full((k,), -1, dtype=torch.int64, device=dev)  # fed slot of each node's parent (-1: root)
        anc = torch.zeros(k, max(big_f, 1), dtype=torch.bool, device=dev)  # [N, F] fed ancestors of each node
        fed_out = torch.zeros(max(big_f, 1), out0.shape[-1], dtype=out0.dtype, device=dev)  # [F, H]
        slot_ids = c._slot_ids  # [P]
        fed_slots = ctx + slot_ids[: max(big_f, 1)]  # [F] window slots of the fed nodes
        eye_f = torch.eye(max(big_f, 1), dtype=torch.bool, device=dev)
        eye_k = torch.eye(k, dtype=torch.bool, device=dev)
        start, size = 0, k  # the level before: node range
        for d in range(2, depth + 1):
            order = torch.sort(cum[start : start + size], descending=True, stable=True).indices[:k]
            chosen = (start + order).sort().values  # [K] node ids, ascending
            f0 = (d - 2) * k  # fed slots f0..f0+K-1
            ps = pslot[chosen]
            feats = torch.where((ps >= 0)[:, None], fed_out[ps.clamp(min=0)], out0.expand(k, -1))  # [K, H]
            ancestors = anc[chosen]  # [K, F]
            seen = (slot_ids < ctx)[None] | torch.zeros(k, slot_ids.shape[0], dtype=torch.bool, device=dev).scatter_(
                1, fed_slots[None].expand(k, -1), ancestors
            )  # [K, P]
            mask = torch.cat([seen, eye_k], dim=1)  # [K, P + K]
            pos = (ctx - 1 + (d - 1)).expand(k)
            out, key_rows, value_rows = head.step(head.embed(c.d2t[tok[chosen]]), feats, pos, c.keys, c.values, mask)
            slots = fed_slots[f0 : f0 + k]
            c.keys.index_copy_(0, slots, key_rows)
            c.values.index_copy_(0, slots, value_rows)
            fed_out[f0 : f0 + k] = out
            kids = self._children(
                head.logits(out), cum[chosen], valid[chosen], k, None if noise is None else noise[1 + f0 : 1 + f0 + k]
            )
            tok = torch.cat([tok, kids[0].reshape(-1)])
            cum, score, valid = (torch.cat([a, b.reshape(-1)]) for a, b in zip((cum, score, valid), kids[1:4]))
            if sampled:
                declared.append(kids[4].reshape(k * k, -1))
            parent = torch.cat([parent, chosen.repeat_interleave(k)])
            pslot = torch.cat([pslot, (f0 + torch.arange(k, device=dev)).repeat_interleave(k)])
            anc = torch.cat([anc, (ancestors | eye_f[f0 : f0 + k]).repeat_interleave(k, dim=0)])
            start, size = start + size, k * k
        n = tok.shape[0]
        m = min(num_nodes, n)
        order = torch.sort(score, descending=True, stable=True).indices[:m]
        keep = valid[order]
        kept = torch.where(keep, order, order + n).sort().values  # valid ones first, in node order
        kept = torch.where(kept < n, kept, kept - n)
        renumber = torch.full((n,), -1, dtype=torch.int64, device=dev).scatter_(0, kept, torch.arange(m, device=dev))
        par = parent[kept]
        result, q_out = self._out(key)
        result[:1].copy_(keep.sum().reshape(1))
        result[1 : 1 + m].copy_(c.d2t[tok[kept]])
        result[1 + m :].copy_(torch.where(par >= 0, renumber[par.clamp(min=0)], par))
        if sampled:
            q_out.copy_(torch.cat(declared)[kept])

    # ---- replay ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(
        self,
        spec: TreeSpec,
        sampling: SamplingParams,
        generator: torch.Generator,  # the session's (sampled requests: seeds the replay's noise)
    ) -> tuple[list[int], list[int], torch.Tensor | None]:  # target ids [n], parents [n], q [n, Vd] (sampled)
        """The tree after the chain graphs' catch_up or load (window, ctx and out0 in place)."""
        sampled = not sampling.greedy
        key = ("tree", spec.num_nodes, spec.top_k, spec.depth, sampled)
        result, q = self._out(key)
        if sampled:
            self.sampler.set(sampling, generator, 1 + (spec.depth - 1) * spec.top_k)
        self._capture_late(key, MAX_TREE_GRAPHS)
        self._run(key)
        values = result.tolist()  # the tree's one device read (q follows it)
        m, count = (len(values) - 1) // 2, values[0]
        return values[1 : 1 + count], values[1 + m : 1 + m + count], (q[:count].clone() if sampled else None)
