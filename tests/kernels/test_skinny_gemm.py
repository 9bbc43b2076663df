"""The skinny GEMM (kernels/skinny_gemm.py) against its pure-torch reference.

Fresh random inputs for every case, NaN-filled outputs (every element must be written), the layer shapes of the
real-size demos on CUDA and small odd shapes under TRITON_INTERPRET=1; row-count invariance (row j of a 17-row call
equals a 1-row call of that row, bit for bit); a negative control (a kernel that skips K's last block) that the
comparison catches.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, randn
from kernel_test_utils import poison_cuda_allocator, rel_err

from specserve.kernels import skinny_gemm
from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.skinny_gemm import HAS_TRITON, MAX_ROWS, skinny_linear
from specserve.kernels.skinny_gemm_reference import skinny_linear_reference

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
DTYPE = torch.bfloat16 if ON_CUDA else torch.float16  # the interpreter multiplies bf16 dots as raw bits
runs_kernels = pytest.mark.skipif(
    not (HAS_TRITON and (ON_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)
# (N, K): Moonlight's merged q + kv_a, o_proj, shared experts' gate_up (silu_mul) and down; K2.6's kv_a; odd sizes
CUDA_SHAPES = [
    (3072 + 576, 2048, "none"),
    (2048, 2048, "none"),
    (2 * 2816, 2048, "silu_mul"),
    (2048, 2816, "none"),
    (576 + 1536, 7168, "none"),
    (200, 72, "none"),
    (2 * 40, 300, "silu_mul"),
]
CPU_SHAPES = [(48, 40, "none"), (2 * 24, 72, "silu_mul")]
SHAPES = CUDA_SHAPES if ON_CUDA else CPU_SHAPES


def _case(n: int, k: int, m: int, epilogue: str, bias: bool, add: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = randn((m, k), gen, DEVICE, DTYPE)
    w = randn((n, k), gen, DEVICE, DTYPE, scale=k**-0.5)
    b = randn((n,), gen, DEVICE, DTYPE) if bias else None
    n_out = n // 2 if epilogue == "silu_mul" else n
    a = randn((m, n_out), gen, DEVICE, DTYPE) if add else None
    return x, w, b, a, n_out


@pytest.mark.gpu
@runs_kernels
@pytest.mark.parametrize("n,k,epilogue", SHAPES)
@pytest.mark.parametrize("m", [1, 4, 17, MAX_ROWS])
@pytest.mark.parametrize("bias,add", [(False, False), (True, True)], ids=["plain", "bias+add"])
def test_skinny_linear_matches_reference(n, k, epilogue, m, bias, add):
    x, w, b, a, n_out = _case(n, k, m, epilogue, bias, add, seed=n + 7 * k + m)
    ref = skinny_linear_reference(x, w, b, epilogue, a)
    out = nan_like((m, n_out), DEVICE, DTYPE)
    if ON_CUDA:
        poison_cuda_allocator()
    got = skinny_linear(x, w, b, epilogue=epilogue, add=a, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "an output element was not written"
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@runs_kernels
@pytest.mark.parametrize("n,k,epilogue", SHAPES[:3])
def test_skinny_linear_rows_do_not_depend_on_the_other_rows(n, k, epilogue):
    x, w, b, a, _ = _case(n, k, 17, epilogue, True, True, seed=3 * n + k)
    tile = None if ON_CUDA else skinny_gemm.SkinnyTile(block_k=16, split_k=2)  # a K split here too
    full = skinny_linear(x, w, b, epilogue=epilogue, add=a, tile=tile)
    for j in range(17):
        alone = skinny_linear(x[j : j + 1], w, b, epilogue=epilogue, add=a[j : j + 1], tile=tile)
        assert torch.equal(alone[0], full[j]), f"row {j} differs between a 17-row and a 1-row call"


@pytest.mark.gpu
@runs_kernels
def test_a_kernel_that_skips_the_last_k_block_is_caught(monkeypatch):
    """Negative control: the same launch with K cut by one block gives an output the comparison rejects."""
    n, k, epilogue = SHAPES[0]
    x, w, b, a, _ = _case(n, k, 4, epilogue, False, False, seed=11)
    ref = skinny_linear_reference(x, w)
    real = skinny_gemm._k.skinny_gemm_kernel

    class Truncated:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                args = list(args)
                args[8] = max(1, args[8] - kw["BLOCK_K"])  # K
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(skinny_gemm._k, "skinny_gemm_kernel", Truncated())
    assert rel_err(skinny_linear(x, w), ref) > 1e-2


@pytest.mark.gpu
@runs_kernels
@pytest.mark.parametrize("split_k", [1, 3])
def test_split_k_gives_the_reference_and_leaves_its_counters_at_zero(split_k):
    """A K split (the last program of a column block sums the ranges in order) against the reference, twice on one
    set of counters: each call leaves them at zero, so the second call (a graph replay) is right too."""
    n, k, epilogue = next(shape for shape in SHAPES if shape[2] == "silu_mul")
    counters = skinny_gemm.new_counters(DEVICE, 64)
    tile = skinny_gemm.SkinnyTile(block_k=16 if not ON_CUDA else 256, split_k=split_k)
    for seed in (1, 2):
        x, w, b, a, n_out = _case(n, k, 5, epilogue, True, True, seed=seed)
        out = nan_like((5, n_out), DEVICE, DTYPE)
        skinny_linear(x, w, b, epilogue=epilogue, add=a, out=out, counters=counters, tile=tile)
        assert rel_err(out, skinny_linear_reference(x, w, b, epilogue, a)) < 1e-2
        assert not counters.any(), "a call left a counter set"


def test_skinny_linear_refuses_bad_arguments():
    x = torch.zeros(MAX_ROWS + 1, 8, dtype=torch.bfloat16)
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    with pytest.raises(KernelArgumentError, match="rows"):
        skinny_linear(x, w)
    with pytest.raises(KernelArgumentError, match="K"):
        skinny_linear(x[:2], torch.zeros(16, 9, dtype=torch.bfloat16))
    with pytest.raises(KernelArgumentError, match="even"):
        skinny_linear(x[:2], torch.zeros(15, 8, dtype=torch.bfloat16), epilogue="silu_mul")
    with pytest.raises(KernelArgumentError, match="epilogue"):
        skinny_linear(x[:2], w, epilogue="gelu")
