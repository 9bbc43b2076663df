"""Capturing drafter CUDA graphs, shared by the graph drafters (model_graph.py, eagle3_graph.py, dflash_graph.py and
their drafters)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


def capture_or_record(
    owner: str,  # the graphs' class name, for the warning
    key: tuple,  # the graph's shape
    body: Callable[[], None],  # what the graph records
    pool,  # torch.cuda.graph_pool_handle() shared by the owner's graphs
    graphs: dict,  # key -> torch.cuda.CUDAGraph: the captured graph lands here
    errors: dict,  # key -> why it could not be captured: a failed shape lands here (and runs eagerly)
) -> None:
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            body()
    except Exception as e:
        errors[key] = f"{type(e).__name__}: {e}"
        warnings.warn(f"{owner}: graph {key} not captured, runs eager: {e}", RuntimeWarning, stacklevel=4)
        return
    graphs[key] = graph


def capture_all_or_warn(graphs, what: str):  # graphs: an object with capture(); returns it, or None
    """graphs.capture(), or None with a warning (`what` names the drafter and what then runs eagerly): the drafter
    still serves, eagerly."""
    try:
        graphs.capture()
    except Exception as e:
        warnings.warn(f"{what}: CUDA graphs not captured, run eager: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)
        return None
    return graphs


def use_norm_kernel(module: torch.nn.Module) -> None:
    """Every RMSNorm under `module` as one Triton launch (kernels/norm.py) instead of ~8 kernels, eager and graphs
    alike, where triton is installed (a drafter capturing graphs calls this first)."""
    from specserve.kernels.norm import HAS_TRITON
    from specserve.models.layers import RMSNorm

    if HAS_TRITON:
        for m in module.modules():
            if isinstance(m, RMSNorm):
                m.use_kernel = True
