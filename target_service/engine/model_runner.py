"""ModelRunner: one forward step of the engine, eager or as a CUDA-graph replay.

Graphs are captured at start-up (before any session holds cache blocks: capture writes scratch K/V into the
first blocks) for single-session steps of the configured sizes: T new tokens as a chain (T = 1 is plain decode,
T = k + 1 verifies k drafted tokens) and, optionally, T-node trees. Each graph owns static input buffers (token
ids, positions, cache slots: one [3, T] device tensor filled by one copy from pinned staging) and its attention
backend's step buffers (block tables, lengths, tree mask), refilled by a host-side plan before every replay. A step
with a graph is: plan, stage ids / positions / slots, replay, read the outputs (which stay valid until the next
step). Any other step (prefill, batches of several sessions, contexts past the captured maximum, other capture
layers) runs eagerly through the same model code.

Each graph also ends with the step's summary on the device (`_Graph.summary`, int64 [3]): the last accepted node of
greedy verification when the step is a chain (the drafted tokens are ids[1:]), the target's argmax there (the next
token) and the distinct (MoE layer, expert) pairs the step touched. The engine reads those three numbers with one
copy instead of running acceptance as separate eager ops (`RunOutput.summary`).
"""

from __future__ import annotations

import dataclasses
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


def distinct_experts(routed: torch.Tensor | None, num_experts: int, device: torch.device) -> torch.Tensor:  # [] int64
    """Distinct (MoE layer, expert) pairs in routed [n_moe_layers, T, top_k], counted on the device (no host read)."""
    if routed is None or routed.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    layers = routed.shape[0]
    span = num_experts if num_experts > 0 else int(routed.max()) + 1
    keys = routed.reshape(layers, -1) + torch.arange(layers, device=routed.device)[:, None] * span
    seen = torch.zeros(layers * span, dtype=torch.bool, device=routed.device)
    seen.index_fill_(0, keys.reshape(-1), True)  # (not seen[keys] = True: that copies True to the device, a sync)
    return seen.sum()


def chain_summary(ids: torch.Tensor, logits: torch.Tensor, routed: torch.Tensor | None,
                  num_experts: int) -> torch.Tensor:  # [3] int64
    """(last accepted node, next token, distinct experts) of greedy verification of the chain ids [T] = pending
    token + drafted tokens, given its logits [T, V]: device ops only, so a graph can end with it."""
    top = logits.argmax(-1)  # [T]
    last = (ids[1:] == top[:-1]).long().cumprod(0).sum()  # accepted count == last node of a chain
    nxt = top.index_select(0, last.view(1))[0]  # (not top[last]: a 0-dim index tensor is read on the host)
    return torch.stack([last, nxt, distinct_experts(routed, num_experts, ids.device)])


@dataclass(frozen=True)
class RunOutput:
    """One forward step: after a graph replay these are the graph's static buffers (read them before the next step)."""

    out: object  # ModelOutput
    logits: torch.Tensor  # [T, V] float32
    captured_layers: tuple[int, ...]  # which hidden layers out.captured holds
    summary: torch.Tensor | None  # [3] int64 on the device (chain_summary) when a graph ran; None for eager steps


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [3, T] int64 on the device: ids, positions, slots
    staging: torch.Tensor  # [3, T] int64 pinned host copy the inputs are filled from
    step: object  # the attention backend's step buffers
    out: object  # ModelOutput of the captured forward
    logits: torch.Tensor  # [T, V] float32
    summary: torch.Tensor  # [3] int64 (chain_summary)
    copied: torch.cuda.Event  # the last copy out of `staging` (refilling it first waits for that)


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, *, block_size: int, max_context: int,
                 device: torch.device | str) -> None:
        self.model = model
        moe = getattr(getattr(model, "config", None), "moe", None)
        self.num_experts = int(moe.num_experts) if moe is not None else 0
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
        if attn.slot_mapping.device != self.device:
            attn = dataclasses.replace(attn, slot_mapping=attn.slot_mapping.to(self.device))
        out = self.model(
            torch.tensor(list(ids), dtype=torch.int64, device=self.device),
            torch.tensor(list(pos), dtype=torch.int64, device=self.device),
            attn,
            self.kv_cache,
            capture_layers=capture,
        )
        return RunOutput(out, self.model.compute_logits(out.hidden), capture, None)

    # ---- one step --------------------------------------------------------------------------------
    def run(self, ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch,
            capture: tuple[int, ...] = ()) -> RunOutput:
        """One forward over the T new tokens of `attn` (its slot_mapping may be on the host). A graph serves the step
        when it was captured for the step's shape and returns at least the hidden layers asked for."""
        tree = any(m is not None for m in attn.tree_masks)
        g, used = self._graph_serving(attn.query_lens, tree, capture)
        longest = max(c + q for c, q in zip(attn.context_lens, attn.query_lens))
        if g is None or not self.use_graphs or longest > self.max_context:
            self.eager_steps += 1
            return self._eager(ids, pos, attn, capture)
        backend = self.model.attn_backend
        if backend is not None:
            backend.prepare(attn, g.step)  # host-side plan into the graph's fixed buffers
        g.copied.synchronize()  # never waits in practice: the previous step's results were read since
        host = g.staging.numpy()
        host[0] = ids
        host[1] = pos
        slots_on_device = attn.slot_mapping.is_cuda
        if not slots_on_device:
            host[2] = attn.slot_mapping.numpy()
        g.inputs.copy_(g.staging, non_blocking=True)
        if slots_on_device:  # a caller that staged its own slots
            g.inputs[2].copy_(attn.slot_mapping, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        self.graph_steps += 1
        return RunOutput(g.out, g.logits, used, g.summary)

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
        # [3, T]: the graph reads its ids, positions and cache slots (scratch: no session holds blocks yet) from here
        inputs = torch.stack([torch.zeros(t, dtype=torch.int64), torch.arange(t), torch.arange(t)]).to(dev)
        ids, pos, slots = inputs[0], inputs[1], inputs[2]
        table = tuple(range(-(-t // self.block_size)))
        mask = torch.ones(t, t, dtype=torch.bool).tril() if tree else None
        attn = AttentionBatch(query_lens=(t,), context_lens=(0,), block_tables=(table,), slot_mapping=slots,
                              tree_masks=(mask,))
        backend = self.model.attn_backend
        step = None
        if backend is not None:
            step = backend.new_graph_step(GraphShape((t,), tree, self.max_context))
            backend.prepare(attn, step)

        def forward():
            out = self.model(ids, pos, attn, self.kv_cache, capture_layers=capture)
            logits = self.model.compute_logits(out.hidden)
            return out, logits, chain_summary(ids, logits, out.routed_experts, self.num_experts)

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton / FlashInfer JIT and autotuning happen outside the capture
                forward()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out, logits, summary = forward()
        staging = torch.zeros(3, t, dtype=torch.int64, pin_memory=True)
        return _Graph(graph, inputs, staging, step, out, logits, summary, torch.cuda.Event())
