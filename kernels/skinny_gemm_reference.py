"""Pure-torch reference of the skinny GEMM (kernels/skinny_gemm.py): y = x W^T (+ bias) in fp32, then its epilogue.

skinny_linear_reference(x [M, K], w [N, K], bias [N] | None, epilogue, add [M, N'] | None) -> [M, N']
    epilogue "none": N' = N;  "silu_mul": W holds gate rows then up rows, N' = N / 2, y = silu(gate) * up;
    add (any epilogue): y + add, added in fp32 before the one rounding to the io dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPILOGUES = ("none", "silu_mul")


def skinny_linear_reference(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    epilogue: str = "none",
    add: torch.Tensor | None = None,  # [M, N'] (N' = N, or N / 2 for silu_mul)
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [M, N'] out_dtype (default x's)
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if epilogue == "silu_mul":
        half = y.shape[1] // 2
        y = F.silu(y[:, :half]) * y[:, half:]
    if add is not None:
        y = y + add.float()
    return y.to(out_dtype or x.dtype)
