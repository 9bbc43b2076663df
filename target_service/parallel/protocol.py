"""What rank 0 tells the other ranks: the shard to load, then one command per model/cache operation.

Workers hold no scheduling state: their paged KV cache changes only through these commands (a forward
writes the step's K/V at the slots rank 0 chose; CopySlots moves an accepted tree path), so it stays
the same slot-for-slot as rank 0's, each rank holding its own heads. Sampling and acceptance happen
on rank 0 only; their outcome reaches the workers as the next commands (the slots to keep/copy and the
next step's tokens), so ranks never disagree about a sequence.
Commands travel pickled on the gloo control group (small: token ids, positions, block tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.models.attn_metadata import AttentionBatch


@dataclass(frozen=True)
class ShardSpec:
    """Everything a worker needs to build its shard and cache (sent by rank 0 once, after the rendezvous)."""

    checkpoint: str
    dtype: str  # "float32" | "bfloat16"
    device_type: str  # "cpu" | "cuda"
    tp_size: int
    expert_parallel: bool
    num_blocks: int
    block_size: int
    attention_backend: str = "torch"  # resolved by rank 0 (models/backends.py), the same on every rank
    moe_backend: str = "torch"


@dataclass(frozen=True)
class Forward:
    input_ids: tuple[int, ...]  # [T]
    positions: tuple[int, ...]  # [T]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    slot_mapping: tuple[int, ...]  # [T]
    tree_masks: tuple[torch.Tensor | None, ...]  # CPU bool [q, q] each
    capture_layers: tuple[int, ...]

    @classmethod
    def of(
        cls,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        capture_layers: tuple[int, ...],
    ) -> Forward:
        return cls(
            tuple(input_ids.tolist()),
            tuple(positions.tolist()),
            attn.query_lens,
            attn.context_lens,
            attn.block_tables,
            tuple(attn.slot_mapping.tolist()),
            tuple(None if m is None else m.cpu() for m in attn.tree_masks),
            tuple(capture_layers),
        )

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """(input_ids [T], positions [T], attention batch) on this rank's device."""
        attn = AttentionBatch(
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            block_tables=self.block_tables,
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.int64, device=device),
            tree_masks=self.tree_masks,
        )
        ids = torch.tensor(self.input_ids, dtype=torch.int64, device=device)
        pos = torch.tensor(self.positions, dtype=torch.int64, device=device)
        return ids, pos, attn


@dataclass(frozen=True)
class Logits:
    """Score `rows` hidden rows; the rows themselves follow as a broadcast on the default group."""

    rows: int


@dataclass(frozen=True)
class CopySlots:
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    pass


Command = Forward | Logits | CopySlots | Stop


class Channel:
    """Rank 0 -> all ranks, in order, over the control group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, obj: object) -> None:
        dist.broadcast_object_list([obj], src=0, group=self.group)

    def recv(self) -> object:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_status(self, error: str | None) -> list[str | None]:
        """Every rank's startup error (None = ready), on every rank."""
        out: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, error, group=self.group)
        return out
