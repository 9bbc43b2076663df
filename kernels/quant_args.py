"""The quantized kernels' argument checks (kernels/quant_moe.py's wrappers call them first): dtypes, shapes, scale
blocks, routing and devices, each refusal one line naming the argument; and whether Triton can run them here."""

from __future__ import annotations

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON

_ACT_DTYPES = (torch.bfloat16, torch.float16)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)
_FP8 = (torch.float8_e4m3fn,)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_routing(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    check_tensor("topk_ids", topk_ids, 2, _ID_DTYPES)
    check_tensor("topk_weights", topk_weights, 2, _SCALE_DTYPES)
    check_dim("topk_ids", topk_ids, 0, hidden.shape[0], "number of tokens T = hidden.shape[0]")
    require(
        topk_weights.shape == topk_ids.shape,
        f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}",
    )


def require_triton(hidden: torch.Tensor) -> None:
    require(HAS_TRITON, "the quantized kernels need the triton package, which is not installed")
    require(hidden.is_cuda or triton_interpreting(), f"the quantized kernels need CUDA tensors, got {hidden.device}")


def check_w4a16_args(
    hidden: torch.Tensor,  # [T, H]
    w13_packed: torch.Tensor,  # [E, 2I, H / 8] int32
    w13_scale: torch.Tensor,  # [E, 2I, H / G]
    w2_packed: torch.Tensor,  # [E, H, I / 8] int32
    w2_scale: torch.Tensor,  # [E, H, I / G]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    group_size: int,
) -> tuple[int, int, int, int]:
    """Validate; return (T, H, E, I). H and I must be multiples of group_size (whole words and groups)."""
    check_tensor("hidden", hidden, 2, _ACT_DTYPES)
    for name, t in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
        check_tensor(name, t, 3, (torch.int32,))
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        check_tensor(name, t, 3, _SCALE_DTYPES)
    require(group_size > 0 and group_size % 8 == 0, f"group_size must be a positive multiple of 8, got {group_size}")
    t, h = hidden.shape
    e, two_i, _ = w13_packed.shape
    inter = two_i // 2
    require(
        t >= 1 and two_i % 2 == 0 and two_i > 0, f"need T >= 1 and w13 rows 2*I, got {tuple(hidden.shape)}, {two_i}"
    )
    require(
        h % group_size == 0 and inter % group_size == 0,
        f"H = {h} and I = {inter} must be multiples of group_size {group_size}",
    )
    check_dim("w13_packed", w13_packed, 2, h // 8, "H / 8 words")
    require(
        tuple(w13_scale.shape) == (e, two_i, h // group_size),
        f"w13_scale shape {tuple(w13_scale.shape)} must be {(e, two_i, h // group_size)}",
    )
    require(
        tuple(w2_packed.shape) == (e, h, inter // 8),
        f"w2_packed shape {tuple(w2_packed.shape)} must be {(e, h, inter // 8)}",
    )
    require(
        tuple(w2_scale.shape) == (e, h, inter // group_size),
        f"w2_scale shape {tuple(w2_scale.shape)} must be {(e, h, inter // group_size)}",
    )
    _check_routing(hidden, topk_ids, topk_weights)
    check_same_device(
        [
            ("hidden", hidden),
            ("w13_packed", w13_packed),
            ("w13_scale", w13_scale),
            ("w2_packed", w2_packed),
            ("w2_scale", w2_scale),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ]
    )
    return t, h, e, inter


def check_fp8_moe_args(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w13_scale_inv: torch.Tensor,  # [E, ceil(2I / BO), ceil(H / BI)]
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale_inv: torch.Tensor,  # [E, ceil(H / BO), ceil(I / BI)]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    block: tuple[int, int],
) -> tuple[int, int, int, int]:
    """Validate; return (T, H, E, I)."""
    check_tensor("hidden", hidden, 2, _ACT_DTYPES)
    check_tensor("w13", w13, 3, _FP8)
    check_tensor("w2", w2, 3, _FP8)
    check_tensor("w13_scale_inv", w13_scale_inv, 3, _SCALE_DTYPES)
    check_tensor("w2_scale_inv", w2_scale_inv, 3, _SCALE_DTYPES)
    require(len(block) == 2 and min(block) > 0, f"block must be two positive ints, got {block}")
    bo, bi = block
    t, h = hidden.shape
    e, two_i, _ = w13.shape
    inter = two_i // 2
    require(
        t >= 1 and two_i % 2 == 0 and two_i > 0, f"need T >= 1 and w13 rows 2*I, got {tuple(hidden.shape)}, {two_i}"
    )
    check_dim("w13", w13, 2, h, "hidden size H = hidden.shape[1]")
    require(tuple(w2.shape) == (e, h, inter), f"w2 shape {tuple(w2.shape)} must be {(e, h, inter)}")
    for name, s, rows, cols in (("w13_scale_inv", w13_scale_inv, two_i, h), ("w2_scale_inv", w2_scale_inv, h, inter)):
        want = (e, _ceil(rows, bo), _ceil(cols, bi))
        require(tuple(s.shape) == want, f"{name} shape {tuple(s.shape)} must be {want} (blocks of {list(block)})")
    _check_routing(hidden, topk_ids, topk_weights)
    check_same_device(
        [
            ("hidden", hidden),
            ("w13", w13),
            ("w13_scale_inv", w13_scale_inv),
            ("w2", w2),
            ("w2_scale_inv", w2_scale_inv),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ]
    )
    return t, h, e, inter


def check_fp8_linear_args(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in] e4m3
    scale_inv: torch.Tensor,  # [ceil(out / BO), ceil(in / BI)]
    block: tuple[int, int],
) -> tuple[int, int, int]:
    """Validate; return (T, in, out)."""
    check_tensor("x", x, 2, _ACT_DTYPES)
    check_tensor("weight", weight, 2, _FP8)
    check_tensor("scale_inv", scale_inv, 2, _SCALE_DTYPES)
    require(len(block) == 2 and min(block) > 0, f"block must be two positive ints, got {block}")
    t, k = x.shape
    n = weight.shape[0]
    require(t >= 1, "x must hold at least one row")
    check_dim("weight", weight, 1, k, "input features = x.shape[1]")
    want = (_ceil(n, block[0]), _ceil(k, block[1]))
    require(
        tuple(scale_inv.shape) == want,
        f"scale_inv shape {tuple(scale_inv.shape)} must be {want} (blocks of {list(block)})",
    )
    check_same_device([("x", x), ("weight", weight), ("scale_inv", scale_inv)])
    return t, k, n
