"""Lossless verification of drafted tokens (chains and trees) by the target's sampling rule.

Terms (pending, drafted, accepted, rejected, recovered, bonus, emitted) are the glossary in
``specserve.contract.types``; nodes are indexed as in ``engine/tree.py`` (node 0 = the
pending token, node j = drafted token j - 1).

Rules:

- temperature 0 (greedy): at the current node take the first child whose token equals the target
  argmax there; stop when none does. The next token (recovered or bonus) is the target argmax at the
  last accepted node.
- temperature > 0: multi-draft recursive rejection sampling. At the current node the working
  distribution r starts as the target distribution p there. Children are tried in index order; child
  c with token x, drawn from q_c, is accepted with probability min(1, r(x) / q_c(x)); if it is
  rejected, r <- norm(max(0, r - q_c)) and the next child is tried. When a child is accepted, move to
  it and restart with r = p at that node. When no child is left, the next token is sampled from r:
  this is the recovered token after a rejection and the bonus token at a leaf. A chain is the tree
  where each node has one child, which gives the standard speculative-sampling rule.

The rule is lossless when ``q_c`` is the distribution the drafter actually drew token c from, given
everything drawn before it (for siblings drawn independently, all share their parent's q; for
siblings drawn without replacement, each q excludes earlier siblings). A deterministic pick (top-k,
n-gram, prompt lookup) is drawn from a one-hot q: pass ``probs=None``.

All functions are vectorised over R independent rows sharing one layout (the engine uses R = 1; the
distribution tests use large R). Random numbers come only from the given generator, and their count
depends only on (R, layout), so a seeded generator reproduces the output.
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams
from specserve.models.probs import target_probs

from .tree import StepLayout

_TINY = 1e-30


def align_draft_probs(q: torch.Tensor, vocab: int) -> torch.Tensor:  # [..., Vd] -> [..., vocab] f32
    """Zero-pad (or cut) a draft distribution to the target vocabulary size."""
    q = q.float()
    vd = q.shape[-1]
    if vd < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - vd))
    elif vd > vocab:
        q = q[..., :vocab]
    return q


def _normalize_or(new: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:  # [R, V]
    s = new.sum(-1, keepdim=True)
    return torch.where(s > _TINY, new / s.clamp_min(_TINY), fallback)


def verify_greedy(
    layout: StepLayout,
    draft_tokens: torch.Tensor,  # [R, n] int64
    target_argmax: torch.Tensor,  # [R, n+1] int64, argmax of the target logits at each node
) -> tuple[torch.Tensor, torch.Tensor]:  # last accepted node [R], next token [R]
    rows = draft_tokens.shape[0]
    n = layout.num_nodes - 1
    if layout.is_chain:
        match = (draft_tokens == target_argmax[:, :n]).long()
        last = match.cumprod(dim=1).sum(dim=1)  # accepted count == last node on a chain
    else:
        last = torch.zeros(rows, dtype=torch.long, device=draft_tokens.device)
        for j in range(1, n + 1):
            want = target_argmax.gather(1, last[:, None]).squeeze(1)
            ok = (last == layout.parents[j]) & (draft_tokens[:, j - 1] == want)
            last = torch.where(ok, j, last)
    nxt = target_argmax.gather(1, last[:, None]).squeeze(1)
    return last, nxt


def verify_sampled(
    layout: StepLayout,
    draft_tokens: torch.Tensor,  # [R, n] int64
    p: torch.Tensor,  # [R, n+1, V] float32 target distribution at each node
    q: torch.Tensor | None,  # [R, n, V] float32 distribution each drafted token was drawn from; None = one-hot
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # last accepted node [R], next token [R]
    rows, n1, vocab = p.shape
    n = n1 - 1
    dev = p.device
    if draft_tokens.shape != (rows, n):
        raise ValueError(f"draft_tokens shape {tuple(draft_tokens.shape)} != {(rows, n)}")
    if q is not None and q.shape != (rows, n, vocab):
        raise ValueError(f"draft probs shape {tuple(q.shape)} != {(rows, n, vocab)}")
    u = torch.rand(rows, n, generator=generator, device=dev)  # [R, n]
    ar = torch.arange(rows, device=dev)
    if layout.is_chain:
        px = p[:, :n].gather(2, draft_tokens[..., None]).squeeze(-1)  # [R, n]
        qx = q.gather(2, draft_tokens[..., None]).squeeze(-1) if q is not None else torch.ones_like(px)
        accept = (u * qx < px).long()
        last = accept.cumprod(dim=1).sum(dim=1)  # [R]
        row = p[ar, last]  # [R, V]
        rejected = last < n
        if q is not None:
            q_pad = torch.cat([q, torch.zeros(rows, 1, vocab, device=dev, dtype=q.dtype)], dim=1)
            resid = (row - q_pad[ar, last]).clamp_min(0.0)
        else:
            tok = torch.cat([draft_tokens, draft_tokens.new_zeros(rows, 1)], dim=1)[ar, last]  # [R]
            resid = row.scatter(1, tok[:, None], 0.0)
        resid = torch.where(rejected[:, None], _normalize_or(resid, row), row)
    else:
        last = torch.zeros(rows, dtype=torch.long, device=dev)
        resid = p[:, 0].clone()  # [R, V] working distribution at the current node
        for j in range(1, n + 1):
            x = draft_tokens[:, j - 1]  # [R]
            active = last == layout.parents[j]
            rx = resid.gather(1, x[:, None]).squeeze(1)
            if q is not None:
                qj = q[:, j - 1]
                qx = qj.gather(1, x[:, None]).squeeze(1)
                reduced = (resid - qj).clamp_min(0.0)
            else:
                qx = torch.ones_like(rx)
                reduced = resid.scatter(1, x[:, None], 0.0)
            acc = active & (u[:, j - 1] * qx < rx)
            rej = active & ~acc
            resid = torch.where(rej[:, None], _normalize_or(reduced, resid), resid)
            resid = torch.where(acc[:, None], p[:, j], resid)
            last = torch.where(acc, j, last)
    nxt = torch.multinomial(resid, 1, generator=generator).squeeze(1)
    return last, nxt


def verify_step_device(
    layout: StepLayout,
    draft_tokens: torch.Tensor,  # [n] int64
    logits: torch.Tensor,  # [n+1, V] target logits at each node
    draft_probs: torch.Tensor | None,  # [n, Vd] or None (one-hot)
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # last accepted node [] int64, next token [] int64, on logits' device
    """One sequence's verify, left on the device: nothing here reads a value on the host."""
    vocab = logits.shape[-1]
    if params.greedy:
        last, nxt = verify_greedy(layout, draft_tokens[None], logits.argmax(-1)[None])
    else:
        if generator is None:
            raise ValueError("sampled verification needs a generator")
        p = target_probs(logits, params)[None]
        q = None if draft_probs is None else align_draft_probs(draft_probs.to(logits.device), vocab)[None]
        last, nxt = verify_sampled(layout, draft_tokens[None], p, q, generator)
    return last[0], nxt[0]


def verify_step(
    layout: StepLayout,
    draft_tokens: torch.Tensor,  # [n] int64
    logits: torch.Tensor,  # [n+1, V] target logits at each node
    draft_probs: torch.Tensor | None,  # [n, Vd] or None (one-hot)
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[tuple[int, ...], int]:
    """One sequence's verify: returns (accepted root-to-node path without node 0, next token)."""
    last, nxt = verify_step_device(layout, draft_tokens, logits, draft_probs, params, generator)
    last_node, token = torch.stack([last, nxt]).tolist()
    return layout.path_to(last_node)[1:], token
