"""Lazy dequantizing views of quantized checkpoint tensors, for the unchanged weight loaders.

A quantized Linear is stored as several tensors (INT4 pack-quantized: ``weight_packed``, ``weight_scale``,
``weight_shape``; FP8 block: ``weight`` in e4m3 and ``weight_scale_inv``; formats in
kernels/quant_reference.py). ``open_tensor`` groups them into the one logical ``<module>.weight``
[out, in] the model expects, wrapped in a ``CheckpointSlice``: the weight loaders narrow and index it as
they do a plain tensor, and only the final view is read. Reading a view reads just the packed words /
fp8 rows and the scales that cover its rows and columns (a tensor-parallel rank reads its shard, an
expert-parallel rank nothing of other ranks' experts) and dequantizes them to float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specserve.kernels.quant_reference import dequant_fp8_block, dequant_int4
from specserve.models.checkpoint_slice import CheckpointSlice
from specserve.models.errors import CheckpointError
from specserve.models.layers import WeightShapeError
from specserve.models.quant import Fp8BlockConfig, Int4PackConfig, QuantConfig

INT4_COMPANIONS = (".weight_scale", ".weight_shape")
FP8_COMPANION = ".weight_scale_inv"
FP8_DTYPES = ("F8_E4M3",)
SCALE_DTYPES = ("F32", "BF16", "F16")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _spans(key: Any, shape: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """Per dim (start, stop, dropped) of a CheckpointSlice key (ints and unit-step slices)."""
    keys = key if isinstance(key, tuple) else (key,)
    if keys == (Ellipsis,):
        keys = ()
    keys = keys + (slice(None),) * (len(shape) - len(keys))
    out = []
    for k, size in zip(keys, shape, strict=True):
        if isinstance(k, int):
            out.append((k, k + 1, True))
        else:
            start, stop, _ = k.indices(size)
            out.append((start, stop, False))
    return out


def _drop(w: torch.Tensor, spans: list[tuple[int, int, bool]]) -> torch.Tensor:
    for d in reversed(range(len(spans))):
        if spans[d][2]:
            w = w.select(d, 0)
    return w


class Int4Source:
    """Logical [out, in] float32 weight of a pack-quantized Linear (reads only what a view covers)."""

    def __init__(self, packed: Any, scale: Any, shape: tuple[int, int], group_size: int) -> None:
        self.packed_words, self.scale, self.shape, self.group_size = packed, scale, shape, group_size

    def get_shape(self) -> tuple[int, int]:
        return self.shape

    def __getitem__(self, key: Any) -> torch.Tensor:
        spans = _spans(key, self.shape)
        (r0, r1, _), (c0, c1, _) = spans
        g = self.group_size
        g0 = c0 // g  # first group read; its first column is word-aligned (g % 8 == 0)
        packed = self.packed_words[r0:r1, g0 * g // 8 : _ceil(c1, 8)]  # [rows, words] int32
        scale = self.scale[r0:r1, g0 : _ceil(c1, g)]  # [rows, groups]
        w = dequant_int4(packed, scale, g, c1 - g0 * g)[:, c0 - g0 * g :]
        return _drop(w, spans)

    def packed(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:  # ([rows, cols / 8] int32, [rows, cols / G])
        """The stored words and scales of a 2-d view whose columns start and end on group boundaries."""
        spans = _spans(key, self.shape)
        (r0, r1, dropped_r), (c0, c1, dropped_c) = spans
        g = self.group_size
        if dropped_r or dropped_c or c0 % g or (c1 % g and c1 != self.shape[1]):
            raise WeightShapeError(
                f"int4 columns {c0}..{c1} of {list(self.shape)} do not start and end on groups of {g}"
            )
        return self.packed_words[r0:r1, c0 // 8 : _ceil(c1, 8)], self.scale[r0:r1, c0 // g : _ceil(c1, g)]


def int4_packed(view: CheckpointSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed words, scales) of a view of an int4 pack-quantized tensor, read as stored."""
    if not isinstance(view.source, Int4Source):
        raise WeightShapeError("expected an int4 pack-quantized tensor (weight_packed + weight_scale)")
    return view.source.packed(view.key())


class Fp8Source:
    """Logical [out, in] float32 weight of an FP8 block-scaled Linear (reads only what a view covers)."""

    def __init__(self, weight: Any, scale_inv: Any, block: tuple[int, int]) -> None:
        self.weight, self.scale_inv, self.block = weight, scale_inv, block
        self.shape = tuple(weight.get_shape())

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, key: Any) -> torch.Tensor:
        spans = _spans(key, self.shape)
        (r0, r1, _), (c0, c1, _) = spans
        bo, bi = self.block
        rb, cb = r0 // bo, c0 // bi
        weight = self.weight[r0:r1, c0:c1]  # [rows, cols] e4m3
        scale = self.scale_inv[rb : _ceil(r1, bo), cb : _ceil(c1, bi)]
        w = dequant_fp8_block(weight, scale, self.block, origin=(r0 - rb * bo, c0 - cb * bi))
        return _drop(w, spans)


def fp8_packed(view: CheckpointSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale_inv) of a 2-d view of an fp8 block tensor whose rows and columns start and end on
    block boundaries (or the tensor's end), read as stored."""
    if not isinstance(view.source, Fp8Source):
        raise WeightShapeError("expected an fp8 block-scaled tensor (weight + weight_scale_inv)")
    src = view.source
    spans = _spans(view.key(), src.shape)
    if len(spans) != 2 or any(d for _, _, d in spans):
        raise WeightShapeError("an fp8 view must keep both dims")
    (r0, r1, _), (c0, c1, _) = spans
    (bo, bi), (rows, cols) = src.block, src.shape
    if r0 % bo or c0 % bi or (r1 % bo and r1 != rows) or (c1 % bi and c1 != cols):
        raise WeightShapeError(
            f"fp8 view rows {r0}..{r1}, columns {c0}..{c1} of {list(src.shape)} cut blocks of {list(src.block)}"
        )
    return src.weight[r0:r1, c0:c1], src.scale_inv[r0 // bo : _ceil(r1, bo), c0 // bi : _ceil(c1, bi)]


def is_companion(name: str, quant: QuantConfig | None) -> bool:
    """Scales and shapes are read through the tensor they belong to, never on their own."""
    if isinstance(quant, Int4PackConfig):
        return name.endswith(INT4_COMPANIONS)
    if isinstance(quant, Fp8BlockConfig):
        return name.endswith(FP8_COMPANION)
    return False


def open_tensor(name: str, handles: Mapping[str, Any], quant: QuantConfig | None) -> tuple[str, CheckpointSlice]:
    """(logical name, lazy tensor) of the stored tensor `name`; handles: stored name -> its open
    safetensors file (companions may sit in another shard)."""
    source = handles[name].get_slice(name)
    if isinstance(quant, Int4PackConfig) and name.endswith(".weight_packed"):
        base = name[: -len("_packed")]
        return base, CheckpointSlice.of(_int4(base, source, handles, quant))
    if isinstance(quant, Fp8BlockConfig) and source.get_dtype() in FP8_DTYPES:
        return name, CheckpointSlice.of(_fp8(name, source, handles, quant))
    return name, CheckpointSlice.of(source)


def _companion(base: str, suffix: str, handles: Mapping[str, Any]) -> Any:
    name = base.rsplit(".", 1)[0] + suffix
    if name not in handles:
        raise CheckpointError(f"quantized tensor {base} has no {name} in the checkpoint")
    return handles[name].get_slice(name)


def _int4(base: str, packed: Any, handles: Mapping[str, Any], quant: Int4PackConfig) -> Int4Source:
    scale = _companion(base, ".weight_scale", handles)
    shape_t = _companion(base, ".weight_shape", handles)
    shape = tuple(int(v) for v in shape_t[:].tolist())
    if len(shape) != 2 or min(shape) <= 0:
        raise CheckpointError(f"{base}_shape must hold [out, in], got {list(shape)}")
    out, inp = shape
    want = {"packed": ((out, _ceil(inp, 8)), ("I32",)), "scale": ((out, _ceil(inp, quant.group_size)), SCALE_DTYPES)}
    for what, t in (("packed", packed), ("scale", scale)):
        (wshape, dtypes), got = want[what], tuple(t.get_shape())
        if got != wshape or t.get_dtype() not in dtypes:
            raise CheckpointError(
                f"{base}_{what} is {t.get_dtype()} {list(got)}; pack-quantized [{out}, {inp}] with group "
                f"{quant.group_size} needs {'/'.join(dtypes)} {list(wshape)}"
            )
    return Int4Source(packed, scale, shape, quant.group_size)


def _fp8(name: str, weight: Any, handles: Mapping[str, Any], quant: Fp8BlockConfig) -> Fp8Source:
    shape = tuple(weight.get_shape())
    if len(shape) != 2:
        raise CheckpointError(f"fp8 tensor {name} has shape {list(shape)}; block scaling needs [out, in]")
    scale = _companion(name, FP8_COMPANION, handles)
    want = (_ceil(shape[0], quant.block[0]), _ceil(shape[1], quant.block[1]))
    if tuple(scale.get_shape()) != want or scale.get_dtype() not in SCALE_DTYPES:
        raise CheckpointError(
            f"{name}_scale_inv is {scale.get_dtype()} {list(scale.get_shape())}; {list(shape)} in blocks of "
            f"{list(quant.block)} needs {'/'.join(SCALE_DTYPES)} {list(want)}"
        )
    return Fp8Source(weight, scale, quant.block)
