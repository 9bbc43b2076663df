"""EAGLE-2 style dynamic draft trees, shared by the ``model`` and ``eagle3`` drafters.

The builder only sees logits; the drafter supplies them through ``expand``. Node ids are creation
order, so a parent always comes before its children. The virtual root (-1) is the pending token.

Level 1 takes children of the root from ``root_logits``. Every later level picks the ``top_k`` nodes of
the previous level with the highest cumulative draft log-probability, asks ``expand`` for their logits
and gives each up to ``top_k`` children. Finally the best ``num_nodes`` nodes are kept.

Greedy requests (temperature 0): children are the ``top_k`` most likely tokens (softmax of the raw
logits), a node's score is its cumulative log-probability (EAGLE-2), and ``probs`` is None (the greedy
verify rule only compares tokens).

Sampled requests: the lossless multi-draft rule of the target (``engine/sampler.py``) needs every node
to be a real draw from the distribution it declares. So children are drawn WITHOUT replacement from
q = the request's sampling distribution (temperature/top-k/top-p, same code as the target's sampler)
at their parent; sibling j declares q with siblings 0..j-1 removed and renormalised. Which nodes get
children may depend on their own path (that only conditions what comes after them), but a node's own
value must not decide whether it survives the final cut: there a node's score is its PARENT's
cumulative log-probability, ties kept in sibling order, so the kept siblings are always the first ones
drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specserve.contract.types import SamplingParams, TreeSpec
from specserve.draft_service.drafting import sampling_probs

# expand(tokens, parents, nodes) -> logits [len(nodes), Vd] at those nodes (the draft's next-token
# logits after each node's root-to-node path); tokens/parents describe every node built so far.
Expander = Callable[[Sequence[int], Sequence[int], Sequence[int]], torch.Tensor]


@dataclass(frozen=True)
class BuiltTree:
    tokens: tuple[int, ...]  # [n] draft-vocabulary ids
    parents: tuple[int, ...]  # [n] index of the parent node, -1 = child of the pending token
    probs: torch.Tensor | None  # [n, Vd] float32 distribution node i was drawn from; None when greedy


def build_tree(
    root_logits: torch.Tensor,  # [Vd]
    expand: Expander,
    spec: TreeSpec,
    sampling: SamplingParams,
    generator: torch.Generator,
) -> BuiltTree:
    tokens: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    cum: list[float] = []  # cumulative log-probability of the node's path
    score: list[float] = []  # final-cut score (see module docstring)
    qrows: list[torch.Tensor] = []
    greedy = sampling.greedy

    def add_children(parent: int, parent_cum: float, logits: torch.Tensor, d: int) -> None:
        logits = logits.float()
        if greedy:
            logp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(logp, min(spec.top_k, logp.numel()))
            for lp, tok in zip(top.values.tolist(), top.indices.tolist()):
                tokens.append(tok), parents.append(parent), depth.append(d)
                cum.append(parent_cum + lp), score.append(parent_cum + lp)
            return
        q = sampling_probs(logits[None], sampling)[0].cpu()  # [Vd]
        m = min(spec.top_k, int((q > 0).sum()))
        drawn = torch.multinomial(q, m, replacement=False, generator=generator).tolist()
        remaining = q.clone()
        for tok in drawn:
            declared = remaining / remaining.sum()
            tokens.append(tok), parents.append(parent), depth.append(d)
            cum.append(parent_cum + float(torch.log(q[tok]))), score.append(parent_cum)
            qrows.append(declared)
            remaining = remaining.clone()
            remaining[tok] = 0.0

    add_children(-1, 0.0, root_logits, 1)
    for d in range(2, spec.depth + 1):
        level = [i for i in range(len(tokens)) if depth[i] == d - 1]
        level.sort(key=lambda i: (-cum[i], i))
        chosen = sorted(level[: spec.top_k])
        if not chosen:
            break
        logits = expand(tuple(tokens), tuple(parents), tuple(chosen))  # [len(chosen), Vd]
        for row, node in enumerate(chosen):
            add_children(node, cum[node], logits[row], d)

    order = sorted(range(len(tokens)), key=lambda i: (-score[i], depth[i], i))
    kept = sorted(order[: spec.num_nodes])
    new_index = {old: new for new, old in enumerate(kept)}
    out_parents = tuple(-1 if parents[i] == -1 else new_index[parents[i]] for i in kept)
    probs = None if greedy else torch.stack([qrows[i] for i in kept])
    return BuiltTree(tokens=tuple(tokens[i] for i in kept), parents=out_parents, probs=probs)
