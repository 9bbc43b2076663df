"""ModelRunner: one forward step of the engine, eager or as a CUDA-graph replay.

Graphs are captured at start-up (before any session holds cache blocks: capture writes scratch K/V into the
first blocks) for single-session steps of the configured sizes: T new tokens as a chain (T = 1 is plain decode,
T = k + 1 verifies k drafted tokens) and, optionally, T-node trees. Each graph owns static input buffers (token
ids, positions, cache slots and, in column 0 of a fourth row, the live row count: one [4, T] device tensor filled
by one copy from pinned staging) and its attention backend's step buffers (block tables, lengths, tree mask),
refilled by a host-side plan before every replay. A step with a graph is: plan, stage ids / positions / slots,
replay, read the outputs (which stay valid until the next step). Any other step (prefill, batches of several
sessions, contexts past the captured maximum, other capture layers) runs eagerly through the same model code.

Invariant steps (`invariant_rows` = R > 0, the target's `--invariant-steps`): every single-session step of at most
R new tokens (decode, chain or tree verify) runs at R rows, its new tokens followed by pad rows (pad_step;
AttentionBatch.pad_rows) through one graph (or, eager, the same shapes). Every kernel then sees the same row count
whatever the step carries, so a row's logits are bit for bit those the same token gets in a one-token decode (with
attention backends whose reductions do not depend on the context length either: models/backends.py picks them).
The outputs are the first T rows. Pad rows repeat the last token's id and position but do no work that counts:
slot -1 (no K/V written), no keys in the Triton paged attention, and no expert (the MoE routes the rows from the
live count on to NO_EXPERT). The live count T is device data (AttentionBatch.live_rows: the graph's inputs[3, :1],
refilled each step), so the one captured graph skips as many rows as each step pads.

Each graph also ends with the step's summary on the device (`_Graph.summary`, int64 [3]): the last accepted node of
greedy verification when the step is a chain (the drafted tokens are ids[1:]), the target's argmax there (the next
token) and the distinct (MoE layer, expert) pairs the step touched (pad rows: none). The engine reads those three
numbers with one copy instead of running acceptance as separate eager ops (`RunOutput.summary`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kernels.moe_reference import NO_EXPERT
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache


class GraphCaptureError(RuntimeError):
    """CUDA graphs were asked for where they cannot be captured."""


PADDED = "padded"  # the step kind of invariant steps' one graph (beside False = chain and True = tree)


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
    """Distinct (MoE layer, expert) pairs in routed [n_moe_layers, T, top_k], counted on the device (no host read);
    NO_EXPERT (pad rows) counts as none."""
    if routed is None or routed.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    layers = routed.shape[0]
    span = num_experts if num_experts > 0 else int(routed.max()) + 1
    keys = routed.reshape(layers, -1) + torch.arange(layers, device=routed.device)[:, None] * span
    keys = torch.where(routed.reshape(layers, -1) == NO_EXPERT, layers * span, keys)  # past every pair: not counted
    seen = torch.zeros(layers * span + 1, dtype=torch.bool, device=routed.device)
    seen.index_fill_(0, keys.reshape(-1), True)  # (not seen[keys] = True: that copies True to the device, a sync)
    return seen[:-1].sum()


def chain_summary(
    ids: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor, routed: torch.Tensor | None, num_experts: int
) -> torch.Tensor:  # [3] int64
    """(last accepted node, next token, distinct experts) of greedy verification of the chain ids [T] = pending
    token + drafted tokens at positions pos [T], given its logits [T, V]: device ops only, so a graph can end with
    it. Pad rows repeat the last position, so a row whose position does not grow is never accepted (nor are the
    ones after it); they route to NO_EXPERT, so they add no experts."""
    top = logits.argmax(-1)  # [T]
    ok = (ids[1:] == top[:-1]) & (pos[1:] > pos[:-1])
    last = ok.long().cumprod(0).sum()  # accepted count == last node of a chain
    nxt = top.index_select(0, last.view(1))[0]  # (not top[last]: a 0-dim index tensor is read on the host)
    return torch.stack([last, nxt, distinct_experts(routed, num_experts, ids.device)])


@dataclass(frozen=True)
class RunOutput:
    """One forward step: after a graph replay these are the graph's static buffers (read them before the next step)."""

    out: object  # ModelOutput
    logits: torch.Tensor  # [T, V] float32
    captured_layers: tuple[int, ...]  # which hidden layers out.captured holds
    summary: torch.Tensor | None  # [3] int64 on the device (chain_summary) when a graph ran; None for eager steps


def pad_step(
    ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch, rows: int
) -> tuple[list[int], list[int], AttentionBatch]:
    """The step padded to `rows` rows: pad rows repeat its last new token's id and position, write no K/V (slot -1)
    and are skipped from the live count on (AttentionBatch.pad_rows, live_rows: [1] on the host here; the runner
    moves it, or refills its graph's)."""
    pad = rows - attn.num_tokens
    slots = attn.slot_mapping
    slots = torch.cat([slots, torch.full((pad,), -1, dtype=slots.dtype, device=slots.device)])
    live = torch.tensor([attn.num_tokens], dtype=torch.int64)
    return (
        list(ids) + [ids[-1]] * pad,
        list(pos) + [pos[-1]] * pad,
        dataclasses.replace(attn, slot_mapping=slots, pad_rows=pad, live_rows=live),
    )


def first_rows(run: RunOutput, n: int) -> RunOutput:
    """The first n rows of a padded step's outputs (views)."""
    out = run.out
    out = dataclasses.replace(
        out,
        hidden=out.hidden[:n],
        captured=None if out.captured is None else out.captured[:n],
        routed_experts=None if out.routed_experts is None else out.routed_experts[:, :n],
    )
    return RunOutput(out, run.logits[:n], run.captured_layers, run.summary)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [4, T] int64 on the device: ids, positions, slots, the live row count (column 0)
    staging: torch.Tensor  # [4, T] int64 pinned host copy the inputs are filled from
    step: object  # the attention backend's step buffers
    out: object  # ModelOutput of the captured forward
    logits: torch.Tensor  # [T, V] float32
    summary: torch.Tensor  # [3] int64 (chain_summary)
    copied: torch.cuda.Event  # the last copy out of `staging` (refilling it first waits for that)


class ModelRunner:
    def __init__(
        self,
        model,
        kv_cache: PagedKVCache,
        *,
        block_size: int,
        max_context: int,
        device: torch.device | str,
        invariant_rows: int = 0,
    ) -> None:
        if invariant_rows < 0:
            raise GraphCaptureError(f"invariant_rows must be >= 0, got {invariant_rows}")
        self.model = model
        self.invariant_rows = invariant_rows  # > 0: single-session steps of up to this many tokens run padded to it
        if invariant_rows and hasattr(model, "set_invariant_rows"):
            model.set_invariant_rows(invariant_rows)  # int4 experts: the per-slot GEMV at every padded step
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
        if attn.live_rows is not None and attn.live_rows.device != self.device:
            attn = dataclasses.replace(attn, live_rows=attn.live_rows.to(self.device))
        out = self.model(
            torch.tensor(list(ids), dtype=torch.int64, device=self.device),
            torch.tensor(list(pos), dtype=torch.int64, device=self.device),
            attn,
            self.kv_cache,
            capture_layers=capture,
        )
        return RunOutput(out, self.model.compute_logits(out.hidden), capture, None)

    # ---- one step --------------------------------------------------------------------------------
    def run(
        self, ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch, capture: tuple[int, ...] = ()
    ) -> RunOutput:
        """One forward over the T new tokens of `attn` (its slot_mapping may be on the host). A graph serves the step
        when it was captured for the step's shape and returns at least the hidden layers asked for."""
        n = attn.num_tokens
        if self.invariant_rows and attn.num_seqs == 1 and n <= self.invariant_rows:  # invariant step: padded
            # (also a prefill of up to R tokens: its pad rows write nothing either)
            ids, pos, attn = pad_step(ids, pos, attn, self.invariant_rows)
            return first_rows(self._run(ids, pos, attn, capture, ((self.invariant_rows,), PADDED)), n)
        tree = any(m is not None for m in attn.tree_masks)
        return self._run(ids, pos, attn, capture, (tuple(int(q) for q in attn.query_lens), tree))

    def _run(
        self, ids: Sequence[int], pos: Sequence[int], attn: AttentionBatch, capture: tuple[int, ...], shape: tuple
    ) -> RunOutput:
        g, used = self._graph_serving(shape, capture)
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
        host[3, 0] = attn.num_tokens  # the live row count (read by padded graphs only)
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

    def _graph_serving(self, shape: tuple, capture: tuple[int, ...]):
        """The graph of this step shape ((query lens, tree or PADDED)) whose captured layers include `capture`
        (fewest extra first), and those layers; (None, capture) when there is none."""
        wanted = set(capture)
        best = None
        for layers in self._capture_sets:
            if wanted <= set(layers) and (best is None or len(layers) < len(best)):
                if (shape, tuple(layers)) in self._graphs:
                    best = layers
        if best is None:
            return None, capture
        return self._graphs[(shape, tuple(best))], best

    def graph_for(self, query_lens: Sequence[int], tree: bool = False, capture: tuple[int, ...] = ()):
        """The captured torch.cuda.CUDAGraph of a step shape, or None (invariant steps: the one padded graph)."""
        shape = ((self.invariant_rows,), PADDED) if self.invariant_rows else (tuple(int(q) for q in query_lens), tree)
        g = self._graphs.get((shape, tuple(capture)))
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
            raise GraphCaptureError(
                "CUDA graphs need a graph-safe attention backend (flashinfer, triton_paged or paged_torch; the "
                "per-sequence torch attention reads lengths on the host)"
            )
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if tuple(options.capture_layers) not in self._capture_sets:
            self._capture_sets.append(tuple(options.capture_layers))
        shapes = [(int(n), False) for n in options.chain_sizes] + [(int(n), True) for n in options.tree_sizes]
        if self.invariant_rows:  # one graph serves every single-session step: padded, with a mask (chains too)
            shapes = [(self.invariant_rows, PADDED)]
        for t, tree in sorted(set(shapes), reverse=True):
            if t + 1 > self.max_context:
                raise GraphCaptureError(f"a graph of {t} new tokens does not fit max_context {self.max_context}")
            key = (((t,), tree), tuple(options.capture_layers))
            if key in self._graphs:
                continue
            try:
                self._graphs[key] = self._capture_one(t, bool(tree), tuple(options.capture_layers), tree == PADDED)
            except Exception as e:  # that shape stays eager; the engine still serves it
                self.capture_errors[key] = f"{type(e).__name__}: {e}"
                warnings.warn(
                    f"CUDA graph for {t} new tokens (tree {tree}) not captured, runs eager: {e}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        torch.cuda.synchronize(self.device)

    def _capture_one(self, t: int, tree: bool, capture: tuple[int, ...], padded: bool) -> _Graph:
        from specserve.kernels.attention import GraphShape

        dev = self.device
        # [4, T]: the graph reads its ids, positions and cache slots (scratch: no session holds blocks yet) from here,
        # and a padded graph its live row count (the rows from it on skip their experts; see the module docstring)
        inputs = torch.stack(
            [
                torch.zeros(t, dtype=torch.int64),
                torch.arange(t),
                torch.arange(t),
                torch.full((t,), t, dtype=torch.int64),
            ]
        ).to(dev)
        ids, pos, slots = inputs[0], inputs[1], inputs[2]
        table = tuple(range(-(-t // self.block_size)))
        mask = torch.ones(t, t, dtype=torch.bool).tril() if tree else None
        attn = AttentionBatch(
            query_lens=(t,),
            context_lens=(0,),
            block_tables=(table,),
            slot_mapping=slots,
            tree_masks=(mask,),
            live_rows=inputs[3, :1] if padded else None,
        )
        backend = self.model.attn_backend
        step = None
        if backend is not None:
            step = backend.new_graph_step(GraphShape((t,), tree, self.max_context))
            backend.prepare(attn, step)

        def forward():
            out = self.model(ids, pos, attn, self.kv_cache, capture_layers=capture)
            logits = self.model.compute_logits(out.hidden)
            return out, logits, chain_summary(ids, pos, logits, out.routed_experts, self.num_experts)

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton / FlashInfer JIT and autotuning happen outside the capture
                forward()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out, logits, summary = forward()
        staging = torch.zeros(4, t, dtype=torch.int64, pin_memory=True)
        return _Graph(graph, inputs, staging, step, out, logits, summary, torch.cuda.Event())
