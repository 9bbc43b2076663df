"""Paged KV cache: per layer a tensor [num_blocks, block_size, *entry_shape] addressed by flat slots."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.models.attn_metadata import logical_to_slots


class KVCacheError(ValueError):
    """Bad arguments to the paged KV cache (shape, slot or layer out of range)."""


class PagedKVCache:
    """Slot s of a layer lives at block s // block_size, offset s % block_size."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        entry_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_layers <= 0 or num_blocks <= 0 or block_size <= 0:
            raise KVCacheError(
                f"num_layers, num_blocks, block_size must be > 0, got {num_layers}, {num_blocks}, {block_size}"
            )
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.entry_shape = tuple(int(x) for x in entry_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = [
            torch.zeros((num_blocks, block_size, *self.entry_shape), dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_slots(self) -> int:
        return self._num_blocks * self._block_size

    def _flat(self, layer: int) -> torch.Tensor:  # [num_slots, *entry_shape]
        if not 0 <= layer < len(self.layers):
            raise KVCacheError(f"layer {layer} out of range [0, {len(self.layers)})")
        return self.layers[layer].view(self.num_slots, *self.entry_shape)

    def _check_slots(self, slots: torch.Tensor, allow_skip: bool) -> None:
        if slots.numel() == 0:
            return
        lo = -1 if allow_skip else 0
        if int(slots.min()) < lo or int(slots.max()) >= self.num_slots:
            raise KVCacheError(
                f"slot out of range [{lo}, {self.num_slots}): min {int(slots.min())}, max {int(slots.max())}"
            )

    def write(self, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """slots [T] int64 (-1 = skip), entries [T, *entry_shape]."""
        if tuple(entries.shape) != (slots.numel(), *self.entry_shape):
            raise KVCacheError(f"entries shape {tuple(entries.shape)} != ({slots.numel()}, *{self.entry_shape})")
        slots = slots.to(device=self.device, dtype=torch.int64)
        self._check_slots(slots, allow_skip=True)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, entries = slots[keep], entries[keep]
        self._flat(layer).index_copy_(0, slots, entries.to(self.dtype))

    def write_step(self, layer: int, slots: torch.Tensor, entries: torch.Tensor, skips: bool = False) -> None:
        """The attention backends' write inside a step: slots [T] int64 on the device, entries [T, *entry_shape]; no
        checks and no host reads, so a CUDA graph can capture it (`write` checks). skips=False: every slot is >= 0.
        skips=True: a slot of -1 writes nothing (pad rows): that row rewrites the first written row's slot with
        that row's entry instead (or, when no row writes, slot 0 with what it holds), so each slot gets one value."""
        flat = self.layers[layer].view(self.num_slots, *self.entry_shape)
        entries = entries.to(self.dtype)
        if skips:
            keep = slots >= 0  # [T]
            rows = torch.arange(slots.numel(), device=slots.device)
            src = torch.where(keep, rows, keep.int().argmax())  # [T] (argmax: the first written row; 0 if none)
            written = keep.any()
            slots = torch.where(written, slots.index_select(0, src), 0)
            entries = torch.where(written, entries.index_select(0, src), flat[:1])
        flat.index_copy_(0, slots, entries)

    def gather(self, layer: int, block_table: Sequence[int], length: int) -> torch.Tensor:
        """The first `length` tokens of a sequence: [length, *entry_shape]."""
        slots = torch.tensor(logical_to_slots(block_table, self._block_size, 0, length), dtype=torch.int64)
        self._check_slots(slots, allow_skip=False)
        return self._flat(layer).index_select(0, slots.to(self.device))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries slot src[i] -> dst[i] in every layer (src read fully before any write)."""
        if src.shape != dst.shape or src.dim() != 1:
            raise KVCacheError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be equal 1-D shapes")
        src = src.to(device=self.device, dtype=torch.int64)
        dst = dst.to(device=self.device, dtype=torch.int64)
        self._check_slots(src, allow_skip=False)
        self._check_slots(dst, allow_skip=False)
        for layer in range(len(self.layers)):
            flat = self._flat(layer)
            flat.index_copy_(0, dst, flat.index_select(0, src))
