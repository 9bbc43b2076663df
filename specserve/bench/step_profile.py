"""Kernel census of one target step: `specserve bench step --census`.

For each model (the shipped demo target, demo@NAME[:LAYERS], synthetic presets such as `synthetic:qwen3-30b-a3b`;
step_bench.model_name: a bare preset name is synthetic) and each drafted
block size k, it runs real `TargetEngine.verify` steps (CUDA-graph replays where the engine has a graph for the
shape, eager steps elsewhere; drafted tokens random, so most are rejected and the context grows by about one token
a step) and reports, per step:

- wall time (host clock around verify, the step's own result read included), median over --steps;
- kernels launched, per step and per decoder layer, and their summed device time (torch profiler);
- device-to-host copies (each one is a host synchronisation);
- the bytes floor (dense weights + the routed experts the step touched + K/V read) at the measured copy
  bandwidth, and wall / floor;
- the top kernels by time.

The front door prints the rows and writes them to --out's summary.json. GPU only: on a CPU it says so in one line.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from specserve.errors import SpecserveError

DEFAULT_MODELS = ("demo", "synthetic:qwen3-30b-a3b")


def _kernel_events(prof) -> list:
    """Device kernels of a profile (memcpy / memset excluded)."""
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if name.startswith(("Memcpy", "Memset")):
            continue
        out.append(e)
    return out


def _dtoh_copies(prof) -> int:
    return sum(1 for e in prof.events() if "DtoH" in e.name and e.device_type == torch.autograd.DeviceType.CUDA)


def _event_us(e) -> float:
    return float(e.time_range.elapsed_us())


def host_profile(engine, session_id: str, block, steps: int, top: int = 20) -> list[dict]:
    """cProfile of `steps` verify steps: where the host's share of a step goes (functions by own time)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.verify(session_id, block)
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "calls_per_step": c / steps,
            "own_us_per_step": own / steps * 1e6,
            "cum_us_per_step": cum / steps * 1e6,
        }
        for (f, line, name), (_, c, own, cum, _) in rows
    ]


def census(engine, session_id: str, block, steps: int) -> dict:
    """Profile `steps` verify steps of one block size; returns per-step figures (device times in ms)."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(steps):  # unprofiled: wall per step
        t0 = time.perf_counter()
        res = engine.verify(session_id, block)
        walls.append((time.perf_counter() - t0) * 1e3)
    experts = res.experts_touched
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.verify(session_id, block)
        torch.cuda.synchronize()
    kernels = _kernel_events(prof)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(_event_us(e))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))  # every kernel: the census reads per-layer counts
    return {
        "wall_ms": statistics.median(walls),
        "kernels_per_step": len(kernels) / steps,
        "kernel_ms_per_step": sum(_event_us(e) for e in kernels) / steps / 1e3,
        "dtoh_copies_per_step": _dtoh_copies(prof) / steps,
        "experts_touched": experts,
        "top_kernels": [
            {"name": name[:120], "per_step": len(ts) / steps, "ms_per_step": sum(ts) / steps / 1e3} for name, ts in top
        ],
    }


MODES = MappingProxyType(
    {  # name -> EngineConfig overrides
        "auto": MappingProxyType({}),  # the engine as it serves: FlashInfer or Triton paged attention, CUDA graphs
        "triton": MappingProxyType({"attention_backend": "triton_paged"}),  # Triton paged attention at any size
        "unfused": MappingProxyType({"fused_layers": False}),  # the graphs without the fused layers
        "skinny": MappingProxyType({"skinny_gemm": True}),  # the fused layers' projections through the skinny GEMM
        "split_moe": MappingProxyType({"fused_moe_block": False}),  # gate GEMM + router kernel, shared MLP apart
        "unfolded": MappingProxyType({"fold_epilogues": False}),  # top-k sum and W_UV in launches of their own
        "eager": MappingProxyType(
            {"attention_backend": "torch", "cuda_graphs": False}
        ),  # per-sequence torch, no graphs
    }
)


@dataclass(frozen=True)
class CensusConfig:
    """What `specserve bench step --census` profiles (its flags)."""

    models: tuple[str, ...] = DEFAULT_MODELS
    k: tuple[int, ...] = (0, 3)  # drafted tokens per step (0 = decode)
    modes: tuple[str, ...] = ("auto",)  # engine modes (MODES)
    context: int = 512  # prompt tokens before the profiled steps
    steps: int = 20
    host_profile: bool = False  # also cProfile the host side of the steps
    device: str = "cuda"
    dtype: str = "bfloat16"
    invariant_steps: bool | None = None  # EngineConfig.invariant_steps (--invariant-steps): None = the engine's default

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise SpecserveError(f"--modes: choose from {', '.join(MODES)}, got {','.join(self.modes)!r}")
        if not self.k or min(self.k) < 0 or self.steps < 1 or self.context < 2:
            raise SpecserveError("bench step --census needs every --k >= 0, --steps >= 1 and a context >= 2")
        if not (self.device.startswith("cuda") and torch.cuda.is_available()):
            raise SpecserveError("bench step --census needs a CUDA GPU (--device cuda): it counts device kernels")


def profile_model(spec: str, mode: str, args: CensusConfig, bandwidth: float) -> list[dict]:
    from specserve.bench.floors import floor_ms, step_bytes
    from specserve.bench.model_bytes import model_bytes
    from specserve.bench.step_bench import model_name
    from specserve.contract.types import DraftBlock
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig, build_engine

    model = demo_checkpoint("target") if spec == "demo" else model_name(spec)
    ctx = args.context
    blocks = -(-(ctx + args.steps * 2 * (max(args.k) + 1) + 64) // 16) + 8
    engine = build_engine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            num_kv_blocks=blocks,
            graph_max_draft=max(args.k),
            invariant_steps=args.invariant_steps,
            **MODES[mode],
        )
    )
    cfg = engine.config
    mb = model_bytes(engine.model, cfg)
    runner = engine.runner
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k in args.k:
        sid = f"census-{k}"
        prompt = torch.randint(1, cfg.vocab_size, (ctx,), generator=gen).tolist()
        engine.prefill(sid, prompt)
        block = DraftBlock(token_ids=tuple(torch.randint(1, cfg.vocab_size, (k,), generator=gen).tolist()))
        for _ in range(3):  # warm-up (JIT, autotuning, allocator)
            engine.verify(sid, block)
        graphs_before = runner.graph_steps
        row = census(engine, sid, block, args.steps)
        if args.host_profile:
            row["host_profile"] = host_profile(engine, sid, block, args.steps)
        row.update(
            model=spec,
            mode=mode,
            k=k,
            tokens=k + 1,
            context=engine.session(sid).cached_len,
            graph_replay=runner.graph_steps > graphs_before,
            num_layers=cfg.num_layers,
            invariant_rows=runner.invariant_rows,
        )  # 0: the step ran unpadded
        row["kernels_per_layer"] = row["kernels_per_step"] / cfg.num_layers
        sb = step_bytes(mb, k + 1, min(row["experts_touched"], mb.max_experts), row["context"])
        row["floor_bytes"] = sb.total
        row["floor_ms"] = floor_ms(sb.total, bandwidth)
        row["wall_over_floor"] = row["wall_ms"] / row["floor_ms"]
        rows.append(row)
        engine.release(sid)
    del engine, runner, mb  # and collect: the engine's parts refer to each other, so the next mode's model fits
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def run_census(args: CensusConfig) -> dict:
    """The census rows of every model x mode x k, and the copy bandwidth their floors use."""
    from specserve.bench.bandwidth import measure_copy_bandwidth

    bw = measure_copy_bandwidth(args.device, 1 << 30)
    rows = []
    for spec in args.models:
        for mode in args.modes:
            rows.extend(profile_model(spec, mode, args, bw.bytes_per_s))
    return {"bandwidth": bw.as_dict(), "rows": rows}


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        padded = f", invariant {r['invariant_rows']} rows" if r.get("invariant_rows") else ", not invariant"
        lines.append(
            f"{r['model']} [{r['mode']}{padded}] k={r['k']} ctx={r['context']} graph={r['graph_replay']}: wall "
            f"{r['wall_ms']:.3f} ms, {r['kernels_per_step']:.0f} kernels ({r['kernels_per_layer']:.1f}/layer) "
            f"{r['kernel_ms_per_step']:.3f} ms, {r['dtoh_copies_per_step']:.1f} DtoH, floor "
            f"{r['floor_ms']:.3f} ms ({r['wall_over_floor']:.1f}x)"
        )
        for t in r["top_kernels"][:6]:
            lines.append(f"    {t['ms_per_step']:.4f} ms  x{t['per_step']:.0f}  {t['name'][:90]}")
        for h in r.get("host_profile", [])[:12]:
            lines.append(
                f"    host {h['own_us_per_step']:7.1f} us own {h['cum_us_per_step']:8.1f} us cum "
                f"x{h['calls_per_step']:.0f}  {h['function'][:70]}"
            )
    return "\n".join(lines)
