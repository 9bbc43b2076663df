"""The hidden rows a session reads, beside the engine that makes them (engine.py): the row buffer of the engine's own
that a session without a sink gets (row i = position i, doubled when full; rows returned before stay valid, views
keep the old buffer), and one drafter's layers picked out of the layers a step captured (``LayerColumns``)."""

from __future__ import annotations

import torch

from .session import Session

OWN_ROWS_SPARE = 256  # rows past twice the prompt an engine-owned row buffer starts with (it doubles when full)


def new_rows(
    prompt_len: int, max_context: int, width: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:  # [rows, width]
    """An engine-owned row buffer for a prompt of prompt_len tokens (uninitialised)."""
    return torch.empty(min(max_context, 2 * prompt_len + OWN_ROWS_SPARE), width, dtype=dtype, device=device)


def grow_rows(s: Session, rows: int, max_context: int) -> None:
    """The session's engine-owned row buffer holding at least `rows` rows (doubled, capped at the context); rows
    already returned stay valid (views keep the old buffer)."""
    sink = s.hidden_out
    if rows <= sink.shape[0]:
        return
    grown = torch.empty(
        min(max_context, max(rows, 2 * sink.shape[0])), sink.shape[1], dtype=sink.dtype, device=sink.device
    )
    grown[: s.cached_len].copy_(sink[: s.cached_len])
    s.hidden_out = grown


class LayerColumns:
    """The wanted layers' columns of a step's captured rows, with the gather indices made once."""

    def __init__(self, hidden_size: int) -> None:
        self.hidden_size = hidden_size
        self._index: dict[tuple, torch.Tensor] = {}  # (capture, wanted, device) -> wanted's columns in capture

    def select(
        self, captured: torch.Tensor, capture: tuple[int, ...], wanted: tuple[int, ...]
    ) -> torch.Tensor:  # [N, len(capture) * H] -> [N, len(wanted) * H]
        """A view where the wanted layers are consecutive in `capture` (one drafter's layers among several drafters'
        union), else one gather with an index made once per (capture, wanted) (no host-to-device copy a step)."""
        if capture == wanted:
            return captured
        h = self.hidden_size
        at = [capture.index(i) for i in wanted]
        if at == list(range(at[0], at[0] + len(at))):
            return captured[:, at[0] * h : (at[0] + len(at)) * h]
        key = (capture, wanted, captured.device)
        idx = self._index.get(key)
        if idx is None:
            idx = self._index[key] = torch.tensor(at, device=captured.device)
        cols = captured.view(captured.shape[0], len(capture), h)
        return cols.index_select(1, idx).reshape(captured.shape[0], len(wanted) * h)
