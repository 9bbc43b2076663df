"""The Triton side of programmatic dependent launch (kernels/launch.py): what every kernel does first."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def chain_in(PDL: tl.constexpr):
    """With PDL: wait until the grid before this one has finished (its writes visible), then let the next kernel
    launch. Called before the kernel reads or writes any memory; nothing without PDL (and in the interpreter)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
