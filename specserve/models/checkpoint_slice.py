"""A lazy view of one checkpoint tensor: weight loaders narrow / index it, only the final view is read.

Tensor-parallel ranks take a slice of most weights; with ``safe_open(...).get_slice(name)`` wrapped in
a ``CheckpointSlice``, a rank reads from the safetensors file only the bytes of its own shard (and
nothing for routed experts another rank holds). Supports what the weight loaders use: ``shape``,
``dim()``, ``narrow(dim, start, length)`` and ``[int | slice, ...]`` with unit step.
"""

from __future__ import annotations

from typing import Any

import torch


class CheckpointSliceError(IndexError):
    """An index outside the checkpoint tensor (or a strided slice, which is not supported)."""


class CheckpointSlice:
    def __init__(self, source: Any, shape: tuple[int, ...], index: tuple[Any, ...] | None = None) -> None:
        """source: a safetensors PySafeSlice (or a tensor); shape: the source's full shape.
        index: per source dim an int (dim dropped) or a (start, stop) range; None = everything."""
        self._source = source
        self._full = tuple(int(x) for x in shape)
        self._index = index if index is not None else tuple((0, n) for n in self._full)

    @classmethod
    def of(cls, source: Any) -> CheckpointSlice:
        if isinstance(source, torch.Tensor):
            return cls(source, tuple(source.shape))
        return cls(source, tuple(source.get_shape()))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self._ranges())

    def dim(self) -> int:
        return len(self.shape)

    def _ranges(self) -> list[tuple[int, int]]:
        return [i for i in self._index if not isinstance(i, int)]

    def _source_dim(self, view_dim: int) -> int:
        """Which source dim the view's `view_dim` is."""
        dims = [d for d, i in enumerate(self._index) if not isinstance(i, int)]
        if not -len(dims) <= view_dim < len(dims):
            raise CheckpointSliceError(f"dim {view_dim} out of range for a {len(dims)}-d view")
        return dims[view_dim]

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        d = self._source_dim(dim)
        lo, hi = self._index[d]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise CheckpointSliceError(f"narrow({dim}, {start}, {length}) outside a dim of size {hi - lo}")
        index = list(self._index)
        index[d] = (lo + start, lo + start + length)
        return CheckpointSlice(self._source, self._full, tuple(index))

    def __getitem__(self, key: Any) -> CheckpointSlice:
        keys = key if isinstance(key, tuple) else (key,)
        view = self
        dropped = 0  # ints drop a view dim, so later keys address one dim lower
        for pos, k in enumerate(keys):
            d = pos - dropped
            size = view.shape[d]
            if isinstance(k, slice):
                start, stop, step = k.indices(size)
                if step != 1:
                    raise CheckpointSliceError("strided slices are not supported")
                view = view.narrow(d, start, max(0, stop - start))
            elif isinstance(k, int):
                i = k + size if k < 0 else k
                if not 0 <= i < size:
                    raise CheckpointSliceError(f"index {k} out of range for a dim of size {size}")
                sd = view._source_dim(d)
                index = list(view._index)
                index[sd] = index[sd][0] + i
                view = CheckpointSlice(view._source, view._full, tuple(index))
                dropped += 1
            else:
                raise CheckpointSliceError(f"unsupported index {k!r}")
        return view

    @property
    def source(self) -> Any:
        return self._source

    def key(self) -> Any:
        """The viewed part as a key of the source (ints and unit-step slices; ... for a 0-d tensor)."""
        if not self._index:
            return ...
        return tuple(i if isinstance(i, int) else slice(*i) for i in self._index)

    def materialize(self) -> torch.Tensor:
        """Read the viewed part (only it) from the source."""
        return self._source[self.key()]


def materialize(t: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    return t.materialize() if isinstance(t, CheckpointSlice) else t
