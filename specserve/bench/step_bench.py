"""GPU step benchmark: decode and chain-verify step times of a full-size model against bytes floors.

    specserve bench step [--model qwen3-30b-a3b,kimi-k2-layer,demo@kimi-k2.6:12] [--contexts 128,4096]
                         [--max-k 16] [--reps 30] [--eager-reps 5] [--shard R/N] [--out DIR]

For each model (a synthetic preset of models/presets.py: random bf16 weights built on the GPU; or demo@NAME[:LAYERS],
the shipped demo embedded in a published shape, models/scaled_demo.py; engine from target_service/factory.py
with the fused MoE, FlashInfer attention and CUDA graphs captured for decode and chains of 1..max_k drafted tokens)
and each context length: prefill a random prompt, then for k = 0..max_k time one step over [pending] + k drafted
tokens (TargetEngine.score_block: metadata, plan, forward, logits, rollback; nothing committed), eager and with
the CUDA graph, median of many; plus the graph replay alone (CUDA events). Bytes floor of a step = dense weights
(everything but the routed experts and the embedding table) + the T embedding rows + every distinct
(layer, routed expert) the step's tokens were routed to (VerifyResult.experts_touched of one committed verify of
the same block) + the K/V entries the step reads, over the measured device-to-device copy bandwidth (read + write
bytes). Targets reported (not asserted): Qwen3-30B-A3B decode within 1.15x of its floor, 4-token verify (k = 3)
within 1.25x. Prints a short table last; writes summary.json (bench/result.py; its "results", "bandwidth" and
"device_name" are what k2_projection and the e2e bench's --projection-timings read) and step_bench.md to --out,
after each model.

--shard R/N builds only rank R's shard of an N-way tensor-parallel model in this one process (attention heads,
shared experts, dense MLPs and lm_head rows TP-split as the model code splits them; routed experts expert-parallel:
this rank holds E / N whole experts), without torch.distributed: its all-reduces are skipped and its logits gather
fills the other ranks' columns with zeros (ParallelConfig.collectives=False, a benchmark-only mode), so the rows
time one rank's compute and memory traffic, not the collectives (`specserve bench kernels --suite allreduce` times those;
`specserve bench project` adds them). The floor then counts this rank's bytes: its dense shard, and only the
distinct (layer, expert) pairs the step routed to among this rank's experts (experts_local). The model's EP gives
the other ranks' choices weight 0 on local expert 0, so it also reads that expert (experts_computed counts it).
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from specserve.errors import SpecserveError

TARGETS = {"qwen3-30b-a3b": {0: 1.15, 3: 1.25}}


@dataclass(frozen=True)
class StepBenchConfig:
    """What `specserve bench step` times (its flags)."""

    models: tuple[str, ...] = ("qwen3-30b-a3b", "kimi-k2-layer")  # model names (model_name); a bare preset: synthetic
    contexts: tuple[int, ...] = (128, 4096)  # cached tokens before the step
    max_k: int = 16  # largest number of drafted tokens
    reps: int = 20  # timed steps per point with CUDA graphs
    eager_reps: int = 3  # timed eager steps per point (0: skip eager)
    device: str = "cuda"
    dtype: str = "bfloat16"
    block_size: int = 16  # KV block size
    no_graphs: bool = False  # eager only (CPU smoke runs)
    shard: tuple[int, int] | None = None  # (R, N): time only rank R of an N-way TP shard (routed experts EP)
    seed: int = 0  # weights and prompts
    invariant_steps: bool | None = None  # the target's token-count invariant steps (EngineConfig.invariant_steps)

    def __post_init__(self) -> None:
        if not self.models or not self.contexts:
            raise SpecserveError("bench step needs at least one --model and one --contexts value")
        if self.max_k < 0 or self.reps < 1 or self.eager_reps < 0 or min(self.contexts) < 2:
            raise SpecserveError("bench step needs --max-k >= 0, --reps >= 1, --eager-reps >= 0 and every context >= 2")
        if self.shard is not None:
            rank, size = self.shard
            if not (size >= 2 and 0 <= rank < size):
                raise SpecserveError(f"--shard: expected R/N with N >= 2 and 0 <= R < N, got {rank}/{size}")


def model_name(spec: str) -> str:
    """The engine's name of a --model entry: demo@NAME[:LAYERS] and synthetic:NAME[:LAYERS] as given, a bare preset
    NAME[:LAYERS] as synthetic:NAME[:LAYERS] (the names step_bench took before demo@)."""
    from specserve.models.presets import SYNTHETIC_PREFIX, is_synthetic
    from specserve.models.scaled_shapes import is_scaled_demo

    return spec if is_scaled_demo(spec) or is_synthetic(spec) else SYNTHETIC_PREFIX + spec


def row_label(spec: str) -> str:
    """How rows name the model: without synthetic: (k2_projection and projection.py match preset names)."""
    from specserve.models.presets import SYNTHETIC_PREFIX

    return spec.removeprefix(SYNTHETIC_PREFIX)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _replay_ms(graph, reps: int) -> float:
    """Median device time of one replay (CUDA events around each)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_floor_bytes(roles: dict, config, t: int, experts_touched: int, kv_tokens: int, kv_entry_bytes: int) -> dict:
    """Bytes one step must read at least: dense weights, T embedding rows, touched experts, K/V read."""
    dense = roles["dense"] + t * config.hidden_size * 2
    experts = experts_touched * roles["expert"]
    kv = kv_tokens * kv_entry_bytes * config.num_layers
    return {"dense": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


class LocalRouting:
    """Which routed experts one eager forward of a shard chose, by forward hooks on its routers (graph replays
    run no hooks: use it around an eager step)."""

    def __init__(self, model, first_expert: int, num_local: int) -> None:
        self.first, self.num_local = first_expert, num_local
        self.ids: list[torch.Tensor] = []  # one [T, K] global expert ids per MoE layer
        self._handles = [
            layer.mlp.gate.register_forward_hook(self._hook) for layer in model.model.layers if layer.is_moe
        ]

    def _hook(self, module, inputs, output) -> None:
        self.ids.append(output[0].detach().to("cpu", torch.int64))

    def counts(self) -> tuple[int, int]:
        """(experts_local: distinct (layer, expert) pairs among this rank's experts, experts_computed: those plus
        local expert 0 in each layer where another rank's expert was chosen and expert 0 was not)."""
        local = computed = 0
        for ids in self.ids:
            here = (ids >= self.first) & (ids < self.first + self.num_local)
            chosen = set(ids[here].tolist())
            local += len(chosen)
            computed += len(chosen) + int(bool((~here).any()) and self.first not in chosen)
        return local, computed

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def bench_model(spec: str, args: StepBenchConfig, bandwidth: float, log) -> dict:
    from specserve.contract.types import DraftBlock
    from specserve.models.config import ParallelConfig
    from specserve.models.model_names import resolve_model
    from specserve.models.presets import parameter_bytes
    from specserve.target_service.factory import EngineConfig, build_engine

    device = torch.device(args.device)
    name = model_name(spec)
    config = resolve_model(name).config()
    parallel = None
    if args.shard is not None:
        parallel = ParallelConfig(tp_rank=args.shard[0], tp_size=args.shard[1], ep=True, collectives=False)
    roles = parameter_bytes(config, parallel=parallel)
    max_ctx = max(args.contexts) + args.max_k + 8
    blocks = -(-(max_ctx + 2 * args.max_k + 64) // args.block_size) + 4
    t0 = time.perf_counter()
    engine = build_engine(
        EngineConfig(
            model=name,
            device=args.device,
            dtype=args.dtype,
            num_kv_blocks=blocks,
            kv_block_size=args.block_size,
            cuda_graphs=False if args.no_graphs else None,
            graph_max_draft=args.max_k,
            max_context=max_ctx + 2 * args.max_k + 32,
            bench_shard=args.shard,
            enable_expert_parallel=parallel is not None,
            seed=args.seed,
            invariant_steps=args.invariant_steps,
        )
    )
    build_s = time.perf_counter() - t0
    spec = row_label(spec)
    runner = engine.runner
    backend = type(engine.model.attn_backend).__name__ if engine.model.attn_backend is not None else "torch"
    moe_fn = engine.model.model.layers[config.moe_layers[0]].mlp.experts_fn.__name__ if config.moe_layers else "-"
    kv_entry_bytes = 2
    for n in engine.model.kv_entry_shape():
        kv_entry_bytes *= n
    label = spec if parallel is None else f"{spec} [shard {parallel.tp_rank}/{parallel.tp_size}]"
    log(f"{label}: built in {build_s:.1f}s (attention {backend}, experts {moe_fn}, graphs {len(runner.graph_keys)})")
    gen = torch.Generator().manual_seed(args.seed)
    ids = config.logits_vocab_limit or config.vocab_size  # a demo@ model: the demo's ids (the rest are never tokens)
    rows = []
    for ctx in args.contexts:
        sid = f"bench-{ctx}"
        prompt = torch.randint(0, ids, (ctx - 1,), generator=gen).tolist()
        engine.prefill(sid, prompt)
        for k in range(args.max_k + 1):
            block = DraftBlock(token_ids=tuple(torch.randint(0, ids, (k,), generator=gen).tolist()))
            cached = engine.session(sid).cached_len
            row = {"model": spec, "context": cached, "k": k, "tokens": k + 1}
            runner.use_graphs = True
            graph_logits = engine.score_block(sid, block).clone()  # a replay's logits are the graph's buffer
            graph_steps = runner.graph_steps
            row["graph_ms"] = _median_ms(functools.partial(engine.score_block, sid, block), args.reps, device)
            row["graph_used"] = runner.graph_steps > graph_steps
            graph = runner.graph_for((k + 1,))
            if graph is not None and row["graph_used"]:
                engine.score_block(sid, block)  # leaves the graph planned for this step
                row["replay_ms"] = _replay_ms(graph, args.reps)
            if args.eager_reps:
                runner.use_graphs = False
                eager_logits = engine.score_block(sid, block)
                row["eager_ms"] = _median_ms(functools.partial(engine.score_block, sid, block), args.eager_reps, device)
                row["graph_vs_eager_max_abs"] = float((graph_logits - eager_logits).abs().max())
                row["graph_argmax_equal"] = bool(torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1)))
                runner.use_graphs = True
            floor_experts = None
            if parallel is not None and config.moe_layers:  # this rank's experts, from one eager step's routing
                routing = LocalRouting(engine.model, parallel.tp_rank * roles["local_experts"], roles["local_experts"])
                runner.use_graphs = False
                try:
                    engine.score_block(sid, block)
                finally:
                    runner.use_graphs = True
                    routing.close()
                floor_experts, row["experts_computed"] = routing.counts()
                row["experts_local"] = floor_experts
            result = engine.verify(sid, block)
            row["experts_touched"] = result.experts_touched
            if floor_experts is None:
                floor_experts = result.experts_touched
            fb = step_floor_bytes(roles, config, k + 1, floor_experts, cached + k + 1, kv_entry_bytes)
            if "experts_computed" in row:
                computed = fb["total"] + (row["experts_computed"] - floor_experts) * roles["expert"]
                row["floor_computed_ms"] = computed / bandwidth * 1e3
            row["floor_bytes"] = fb
            row["floor_ms"] = fb["total"] / bandwidth * 1e3
            best = row.get("replay_ms", row["graph_ms"])
            row["x_floor"] = best / row["floor_ms"]
            target = TARGETS.get(spec, {}).get(k)
            if target is not None:
                row["target_x_floor"] = target
            rows.append(row)
            log(
                f"  ctx {cached} k {k}: "
                + ", ".join(
                    f"{key} {row[key]:.3f}" for key in ("floor_ms", "graph_ms", "replay_ms", "eager_ms") if key in row
                )
            )
        engine.release(sid)
    info = {
        "model": spec,
        "layers": config.num_layers,
        "attention": backend,
        "experts_fn": moe_fn,
        "build_s": build_s,
        "graphs": len(runner.graph_keys),
        "capture_errors": {str(k): v for k, v in runner.capture_errors.items()},
        "weight_bytes": roles,
        "kv_entry_bytes": kv_entry_bytes,
        "rows": rows,
    }
    if parallel is not None:
        info["shard"] = {"rank": parallel.tp_rank, "size": parallel.tp_size, "ep": True, "collectives": False}
        info["lm_head_bytes"] = (
            sum(p.numel() * p.element_size() for p in engine.model.lm_head.parameters())
            if engine.model.lm_head is not None
            else 0
        )
    del engine, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def format_table(results: list[dict], bandwidth: float) -> str:
    lines = [
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write); times in ms; x floor uses replay (graph) time",
        "| model | ctx | k | experts | floor | eager | graph step | replay | x floor | target | graph==eager |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        if "error" in res:
            lines.append(f"| {res['model']} | error: {res['error'][:120]} |")
            continue
        name = (
            res["model"]
            if "shard" not in res
            else f"{res['model']} [shard {res['shard']['rank']}/{res['shard']['size']}]"
        )
        for r in res["rows"]:

            def f(key: str, fmt: str = "{:.3f}") -> str:
                return fmt.format(r[key]) if key in r else "-"

            eq = "-" if "graph_argmax_equal" not in r else ("yes" if r["graph_argmax_equal"] else "NO")
            experts = r["experts_touched"] if "experts_local" not in r else f"{r['experts_local']} here"
            lines.append(
                f"| {name} | {r['context']} | {r['k']} | {experts} | {f('floor_ms')} | "
                f"{f('eager_ms')} | {f('graph_ms')} | {f('replay_ms')} | {f('x_floor', '{:.2f}')} | "
                f"{f('target_x_floor', '{:.2f}')} | {eq} |"
            )
    return "\n".join(lines)


def run_step_bench(args: StepBenchConfig, log, save=None) -> dict:
    """Every model's rows (a model that fails to build or run: its error, the others' rows kept), the copy bandwidth
    the floors use and the GPU's name: the results of `specserve bench step` (its summary.json, which k2_projection
    and the e2e bench's --projection-timings read)."""
    from specserve.bench.bandwidth import measure_copy_bandwidth

    bw = measure_copy_bandwidth(args.device, (1 << 30) if args.device.startswith("cuda") else (64 << 20), 20)
    log(f"copy bandwidth {bw.bytes_per_s / 1e12:.3f} TB/s")
    report = {"bandwidth": bw.as_dict(), "device_name": None, "results": []}
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        report["device_name"] = torch.cuda.get_device_name()
    for spec in args.models:
        try:
            report["results"].append(bench_model(spec, args, bw.bytes_per_s, log))
        except Exception as e:  # keep the other models' numbers; the error goes in the report
            log(traceback.format_exc())
            report["results"].append({"model": row_label(spec), "error": f"{type(e).__name__}: {e}"})
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if save is not None:  # after each model: a run cut short keeps what it measured
            save(report)
    return report
