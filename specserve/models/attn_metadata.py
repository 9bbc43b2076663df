"""Per-step attention metadata: which cached tokens and which new tokens each new token may see."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class AttentionBatchError(ValueError):
    """An AttentionBatch whose fields disagree with each other."""


@dataclass(frozen=True)
class AttentionBatch:
    """T = total new tokens over the batch, in sequence order.

    New token j of sequence b attends to all ``context_lens[b]`` cached tokens (read through its block
    table) plus new tokens j' with ``tree_masks[b][j, j']`` (or j' <= j when the mask is None). Its K/V
    is written to ``slot_mapping`` (slot -1 = do not write).

    ``pad_rows`` extra rows may follow the last sequence's new tokens (a step padded to a fixed row count, the
    target runner's invariant steps). A pad row repeats that sequence's last new token's id and position, but does
    no work anyone reads: its slot is -1 (it writes no K/V), a paged backend that can skip a row gives it none (the
    Triton paged attention: no keys, output 0), and the MoE routes it to no expert (models/moe.py: the rows from
    ``live_rows`` on). Its outputs are garbage to be ignored; the real rows' are bit for bit what they are with any
    other pad rows or none at that row count. Backends that cannot pad refuse a batch with pad rows.

    ``live_rows`` ([1] int64 on the model's device, or None = every row is live) is the count of rows that are not
    pad rows as device data, so one CUDA graph captured at the padded row count serves every step: the runner
    refills it before each replay (the captured batch has pad_rows 0 and its row count in live_rows).
    """

    query_lens: tuple[int, ...]  # [B] new tokens per sequence
    context_lens: tuple[int, ...]  # [B] tokens already in the cache before this step
    block_tables: tuple[tuple[int, ...], ...]  # [B][n_blocks] physical block ids, enough for context+new
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token (block*block_size+offset); -1 = skip
    tree_masks: tuple[torch.Tensor | None, ...]  # [B] each bool [q, q] (True = may attend); None = causal
    pad_rows: int = 0  # rows after the T new tokens repeating the last one's id and position, doing no work
    live_rows: torch.Tensor | None = None  # [1] int64 device count of the non-pad rows; None: every row is live

    def __post_init__(self) -> None:
        b = len(self.query_lens)
        for name in ("context_lens", "block_tables", "tree_masks"):
            if len(getattr(self, name)) != b:
                raise AttentionBatchError(f"{name} has {len(getattr(self, name))} entries for {b} sequences")
        if any(q < 0 for q in self.query_lens) or any(c < 0 for c in self.context_lens):
            raise AttentionBatchError(
                f"negative length in query_lens={self.query_lens} context_lens={self.context_lens}"
            )
        if self.slot_mapping.dim() != 1 or self.slot_mapping.dtype != torch.int64:
            raise AttentionBatchError(
                f"slot_mapping must be a 1-D int64 tensor, got {tuple(self.slot_mapping.shape)} {self.slot_mapping.dtype}"
            )
        if self.pad_rows < 0 or (self.pad_rows and (not b or not self.query_lens[-1])):
            raise AttentionBatchError(f"pad_rows = {self.pad_rows} needs a last sequence with new tokens to copy")
        if self.pad_rows and self.live_rows is None:
            raise AttentionBatchError(f"pad_rows = {self.pad_rows} needs live_rows (the device count the MoE skips by)")
        if self.live_rows is not None and (self.live_rows.shape != (1,) or self.live_rows.dtype != torch.int64):
            raise AttentionBatchError(
                f"live_rows must be a [1] int64 tensor, got {tuple(self.live_rows.shape)} {self.live_rows.dtype}"
            )
        if self.slot_mapping.numel() != self.num_rows:
            raise AttentionBatchError(
                f"slot_mapping has {self.slot_mapping.numel()} entries for {self.num_tokens} new tokens and "
                f"{self.pad_rows} pad rows"
            )
        for i, (mask, q) in enumerate(zip(self.tree_masks, self.query_lens)):
            if mask is None:
                continue
            if mask.dtype != torch.bool or tuple(mask.shape) != (q, q):
                raise AttentionBatchError(
                    f"tree_masks[{i}] must be bool [{q}, {q}], got {mask.dtype} {tuple(mask.shape)}"
                )
            if q and not bool(mask.diagonal().all()):
                raise AttentionBatchError(f"tree_masks[{i}] must let every token attend to itself")

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def may_skip_rows(self) -> bool:
        """Whether some rows may be pad rows (slot -1, no expert): a padded batch, or one captured with live_rows."""
        return self.pad_rows > 0 or self.live_rows is not None

    @property
    def num_rows(self) -> int:
        """Rows of the step: the new tokens, then the pad rows."""
        return self.num_tokens + self.pad_rows

    def token_ranges(self) -> list[tuple[int, int]]:
        """[(start, end)] of each sequence's new tokens within the T new tokens."""
        out, start = [], 0
        for q in self.query_lens:
            out.append((start, start + q))
            start += q
        return out

    @classmethod
    def contiguous(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        tree_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> AttentionBatch:
        """Batch whose new tokens go to the next free logical slots (context_len + j) of each sequence."""
        slots: list[int] = []
        for q, c, table in zip(query_lens, context_lens, block_tables):
            slots.extend(logical_to_slots(table, block_size, c, q))
        masks = tuple(tree_masks) if tree_masks is not None else (None,) * len(query_lens)
        return cls(
            query_lens=tuple(int(q) for q in query_lens),
            context_lens=tuple(int(c) for c in context_lens),
            block_tables=tuple(tuple(int(x) for x in t) for t in block_tables),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            tree_masks=masks,
        )


def logical_to_slots(block_table: Sequence[int], block_size: int, start: int, count: int) -> list[int]:
    """Physical cache slots of logical token positions [start, start + count) of one sequence."""
    need = -(-(start + count) // block_size) if start + count else 0
    if need > len(block_table):
        raise AttentionBatchError(
            f"block table has {len(block_table)} blocks but positions up to {start + count} need {need} "
            f"(block_size {block_size})"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + count)]
