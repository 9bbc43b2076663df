"""The log-probabilities a session asked for (``LogprobsSpec``): each scored token's log_softmax and the
top alternatives at its row, read back to the host; a prompt's a chunk of logits rows at a time."""

from __future__ import annotations

import torch

from specserve.contract.types import TokenLogprobs

PROMPT_LOGITS_ROWS = 512  # prompt logprobs: rows of logits made at once


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> TokenLogprobs:
    """log_softmax of logits [n, V] (float32) at tokens [n] (same device), and the top most likely at each row
    (read back to the host: only for a session that asked)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    if not top:
        return TokenLogprobs(tuple(tokens.tolist()), tuple(chosen.tolist()))
    values, ids = lp.topk(top, dim=-1)
    return TokenLogprobs(
        tuple(tokens.tolist()),
        tuple(chosen.tolist()),
        tuple(map(tuple, ids.tolist())),
        tuple(map(tuple, values.tolist())),
    )


def prompt_logprobs(compute_logits, hidden: torch.Tensor, ids: torch.Tensor, top: int) -> TokenLogprobs:
    """Prompt tokens 1 .. n-1, each scored at the position before it (hidden [n, H], ids [n]); the logits
    are made a chunk of rows at a time, so a long prompt never holds [n, V] at once."""
    n = ids.shape[0]
    parts = [
        token_logprobs(
            compute_logits(hidden[i : min(i + PROMPT_LOGITS_ROWS, n - 1)]), ids[i + 1 : i + 1 + PROMPT_LOGITS_ROWS], top
        )
        for i in range(0, n - 1, PROMPT_LOGITS_ROWS)
    ]
    return TokenLogprobs(
        tuple(t for p in parts for t in p.token_ids),
        tuple(v for p in parts for v in p.logprobs),
        tuple(r for p in parts for r in p.top_ids),
        tuple(r for p in parts for r in p.top_logprobs),
    )
