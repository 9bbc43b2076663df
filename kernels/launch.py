"""Programmatic dependent launch (PDL) of the project's Triton kernels.

A kernel launched with PDL may start while the kernel before it on the stream is still draining: its programs wait in
`griddepcontrol.wait` (kernels/chain_triton.chain_in, the first thing every kernel does) until that grid has finished
and its writes are visible, so the launch latency between two small kernels hides under the first one's tail. Each
kernel then lets the next one launch (`griddepcontrol.launch_dependents`) once all of its own programs run.
Correctness does not depend on it: a kernel waits before it reads or writes anything, and a launch without PDL (a
cuBLAS GEMM, a copy) still waits for everything before it.

It runs on CUDA devices of compute capability >= 9 (Hopper and later). `SPECSERVE_PDL=0` turns it off (a same-run
before/after of the census: `specserve bench step --census` twice).
"""

from __future__ import annotations

import os

import torch

PDL_ENV = "SPECSERVE_PDL"


def chained(t: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel whose tensors live on t's device: PDL (the kernel's constexpr: wait for the
    grid before it, then let the next launch) and launch_pdl (Triton's launch attribute), on together or not at all."""
    on = t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9 and os.environ.get(PDL_ENV, "1") != "0"
    return {"PDL": on, "launch_pdl": on}
