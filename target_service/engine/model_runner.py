"""ModelRunner: one forward step of the engine, eager or as a CUDA-graph replay.

Graphs are captured at start-up (before any session holds cache blocks: capture writes scratch K/V into the
first blocks) for single-session steps of the configured sizes: T new tokens as a chain (T = 1 is plain decode,
T = k + 1 verifies k drafted tokens) and, optionally, T-node trees. Each graph owns static input buffers (token
ids, positions, cache slots) and, on the FlashInfer path, its own CUDA-graph-mode wrappers whose index buffers
(block tables, lengths, tree mask) are refilled by a host-side plan before every replay. A step with a graph is:
plan, copy ids / positions / slots into the static buffers, replay, read the outputs (which stay valid until the
next step). Any other step (prefill, batches of several sessions, contexts past the captured maximum, other
capture layers) runs eagerly through the same model code.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache


class GraphCaptureError(RuntimeError):
    """CUDA graphs were asked for where they cannot be captured."""


@dataclass(frozen=True)
class GraphOptions:
    """Which single-session steps get a CUDA graph."""

    chain_sizes: tuple[int, ...] = tuple(range(1, 18))  # new tokens per step: 1 = decode, k + 1 = chain of k
    tree_sizes: tuple[int, ...] = ()  # node counts (pending token included) of tree steps
    capture_layers: tuple[int, ...] = ()  # hidden layers the graphs return (steps asking for others run eager)

    def __post_init__(self) -> None:
        for name in ("chain_sizes", "tree_sizes"):
            sizes = getattr(self, name)
            if any(int(n) < 1 for n in sizes):
                raise GraphCaptureError(f"{name} must all be >= 1, got {sizes}")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [T] int64
    pos: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    step: object  # StepAttention or None (plain-torch attention)
    out: object  # ModelOutput of the captured forward
    logits: torch.Tensor  # [T, V] float32


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, *, block_size: int, max_context: int,
                 device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_context = max_context
        self.device = torch.device(device)
        self._graphs: dict[tuple, _Graph] = {}
        self._capture_sets: list[tuple[int, ...]] = []  # hidden-layer sets some graphs were captured for
        self._pool = None
        self.capture_errors: dict[tuple, str] = {}  # step shape -> why its graph could not be captured
        self.use_graphs = True  # False: every step eager (benchmarks compare the two on one engine)
        self.graph_steps = 0
        self.eager_steps = 0

    # ---- eager -----------------------------------------------------------------------------------
    def _eager(self, ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch, capture: tuple[int, ...]):
        out = self.model(
            torch.tensor(list(ids), dtype=torch.int64, device=self.device),
            torch.tensor(list(pos), dtype=torch.int64, device=self.device),
            attn,
            self.kv_cache,
            capture_layers=capture,
        )
        return out, self.model.compute_logits(out.hidden)

    # ---- one step --------------------------------------------------------------------------------
    def run(self, ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch, capture: tuple[int, ...] = ()):
        """(ModelOutput, logits [T, V] float32, captured layers) of one forward over the T new tokens of `attn`. A
        graph serves the step when it was captured for the step's shape and returns at least the hidden layers
        asked for; the third item says which layers `ModelOutput.captured` holds. After a replay these are the
        graph's static outputs: read (or copy) them before the next step."""
        tree = any(m is not None for m in attn.tree_masks)
        g, used = self._graph_serving(attn.query_lens, tree, capture)
        longest = max(c + q for c, q in zip(attn.context_lens, attn.query_lens))
        if g is None or not self.use_graphs or longest > self.max_context:
            self.eager_steps += 1
            return (*self._eager(ids, pos, attn, capture), capture)
        backend = self.model.attn_backend
        if backend is not None:
            backend.prepare(attn, g.step)  # host-side plan into the graph's fixed buffers
        t = len(ids)
        g.ids.copy_(torch.tensor(list(ids), dtype=torch.int64), non_blocking=True)
        g.pos.copy_(torch.tensor(list(pos), dtype=torch.int64), non_blocking=True)
        g.slots.copy_(attn.slot_mapping[:t], non_blocking=True)
        g.graph.replay()
        self.graph_steps += 1
        return g.out, g.logits, used

    def _graph_serving(self, query_lens: Sequence[int], tree: bool, capture: tuple[int, ...]):
        """The graph of this step shape whose captured layers include `capture` (fewest extra first), and those
        layers; (None, capture) when there is none."""
        wanted = set(capture)
        best = None
        for layers in self._capture_sets:
            if wanted <= set(layers) and (best is None or len(layers) < len(best)):
                g = self._graphs.get(self._key(query_lens, tree, layers))
                if g is not None:
                    best = layers
        if best is None:
            return None, capture
        return self._graphs[self._key(query_lens, tree, best)], best

    @staticmethod
    def _key(query_lens: Sequence[int], tree: bool, capture: tuple[int, ...]) -> tuple:
        return (tuple(int(q) for q in query_lens), bool(tree), tuple(capture))

    def graph_for(self, query_lens: Sequence[int], tree: bool = False, capture: tuple[int, ...] = ()):
        """The captured torch.cuda.CUDAGraph for a step shape, or None."""
        g = self._graphs.get(self._key(query_lens, tree, capture))
        return None if g is None else g.graph

    # ---- capture ---------------------------------------------------------------------------------
    @property
    def graph_keys(self) -> list[tuple]:
        return sorted(self._graphs)

    def capture(self, options: GraphOptions) -> None:
        """Capture every configured step shape (largest first, one shared memory pool). Call before any session."""
        if self.device.type != "cuda":
            raise GraphCaptureError(f"CUDA graphs need a CUDA device, the engine runs on {self.device}")
        if getattr(self.model, "attn_backend", None) is None or not hasattr(self.model.attn_backend, "new_graph_step"):
            raise GraphCaptureError("CUDA graphs need a graph-safe attention backend (flashinfer, triton_paged or paged_torch; the "
                                    "per-sequence torch attention reads lengths on the host)")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if tuple(options.capture_layers) not in self._capture_sets:
            self._capture_sets.append(tuple(options.capture_layers))
        shapes = [(int(n), False) for n in options.chain_sizes] + [(int(n), True) for n in options.tree_sizes]
        for t, tree in sorted(set(shapes), reverse=True):
            if t + 1 > self.max_context:
                raise GraphCaptureError(f"a graph of {t} new tokens does not fit max_context {self.max_context}")
            key = self._key((t,), tree, tuple(options.capture_layers))
            if key in self._graphs:
                continue
            try:
                self._graphs[key] = self._capture_one(t, tree, tuple(options.capture_layers))
            except Exception as e:  # that shape stays eager; the engine still serves it
                self.capture_errors[key] = f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph for {t} new tokens (tree {tree}) not captured, runs eager: {e}",
                              RuntimeWarning, stacklevel=2)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, t: int, tree: bool, capture: tuple[int, ...]) -> _Graph:
        from specserve.kernels.attention import GraphShape

        dev = self.device
        ids = torch.zeros(t, dtype=torch.int64, device=dev)
        pos = torch.arange(t, dtype=torch.int64, device=dev)
        slots = torch.arange(t, dtype=torch.int64, device=dev)  # scratch: no session holds blocks yet
        table = tuple(range(-(-t // self.block_size)))
        mask = torch.ones(t, t, dtype=torch.bool).tril() if tree else None
        attn = AttentionBatch(query_lens=(t,), context_lens=(0,), block_tables=(table,), slot_mapping=slots,
                              tree_masks=(mask,))
        backend = self.model.attn_backend
        step = None
        if backend is not None:
            step = backend.new_graph_step(GraphShape((t,), tree, self.max_context))
            backend.prepare(attn, step)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton / FlashInfer JIT and autotuning happen outside the capture
                out = self.model(ids, pos, attn, self.kv_cache, capture_layers=capture)
                self.model.compute_logits(out.hidden)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(ids, pos, attn, self.kv_cache, capture_layers=capture)
            logits = self.model.compute_logits(out.hidden)
        return _Graph(graph, ids, pos, slots, step, out, logits)
