"""Capturing drafter CUDA graphs, shared by the graph drafters (model_graph.py, eagle3_graph.py, dflash_graph.py and
their drafters)."""

from __future__ import annotations

import contextlib
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
        warnings.warn(
            f"{what}: CUDA graphs not captured, run eager: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=4
        )
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


class StagedBuffer:
    """A small device buffer that a graph reads, refilled before its replay by one asynchronous copy from pinned host
    memory (no host synchronisation): fill `host()`, then `send()`."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.values = torch.zeros(size, dtype=dtype, device=device)  # [size] what the graphs read
        self._host = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")
        self._host_array = self._host.numpy()  # [size] a view of the pinned memory
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def host(self):  # -> np.ndarray [size], the staging memory to fill
        """The pinned staging array, once the previous copy out of it has run (long ago, in practice: a propose ends on
        a read of its result)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host_array

    def send(self) -> None:
        self.values.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class GraphBodies:
    """Graphs keyed by shape, each one recording `_body(key)` over the subclass's static buffers; a key that is not
    captured (a CPU, before capture(), or a shape that failed to capture) runs its body eagerly over the same buffers.
    Subclasses give `_keys()` (every shape, largest first) and `_body(key)`, and may wrap both capture and eager runs
    in `_context()`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # empty until capture()
        self.capture_errors: dict[tuple, str] = {}  # graph key -> why it was not captured
        self._pool = None  # the graphs' memory pool, made by capture()

    def _keys(self) -> list[tuple]:
        raise NotImplementedError

    def _body(self, key: tuple) -> None:
        raise NotImplementedError

    def _context(self):
        return contextlib.nullcontext()

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm every body up on a side stream (cuBLAS handles, allocator), then capture each into one memory pool
        (call before serving; the weights must not move after)."""
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_keys(self._keys())

    def _capture_keys(self, keys: list[tuple]) -> None:
        """Warm up on a side stream, then capture (torch.cuda.graph itself waits for the whole device first: a shape
        captured on first use costs that step its overlap with a verify on the same GPU)."""
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with self._context(), torch.cuda.stream(stream):
            for key in keys:
                self._body(key)
        torch.cuda.current_stream(dev).wait_stream(stream)
        with self._context():
            for key in keys:
                capture_or_record(
                    type(self).__name__, key, lambda: self._body(key), self._pool, self._graphs, self.capture_errors
                )
        torch.cuda.current_stream(dev).synchronize()  # this thread's stream: a target's work on the GPU goes on

    def _capture_late(self, key: tuple, limit: int) -> None:
        """After capture(): capture one more shape on first use (shapes chosen per request, e.g. tree sizes), at most
        `limit` of them; the warm-up ran the body, so a replay follows to give its results again."""
        if self._pool is None or key in self._graphs or key in self.capture_errors or len(self._graphs) >= limit:
            return
        self._capture_keys([key])

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def _run(self, key: tuple) -> None:  # a replay runs on the calling thread's current stream (the drafter's own)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            with self._context():
                self._body(key)
