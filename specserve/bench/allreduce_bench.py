"""All-reduce micro-benchmark: the per-layer collective of a tensor-parallel decode / verify step, on one host.

    specserve bench kernels --suite allreduce --world-size 4 [--tokens 1,2,4,8,16] [--hidden 7168]
                            [--vocab 163840] [--reps 50] [--calls 20] [--no-graphs] [--out DIR]

N ranks (spawned processes, one GPU each, NCCL; ``--device cpu`` uses gloo, for smoke runs) each all-reduce a
[T, hidden] bf16 tensor (what RowParallelLinear / MoEBlock sum: 2 per decoder layer) for every T of --tokens,
and all-gather their [T, ceil(vocab / N)] float32 logits columns (what ParallelLMHead gathers once per step).
On CUDA, --calls back-to-back collectives are captured in one CUDA graph and each sample is one replay timed with
CUDA events (per call = sample / calls); if capture fails on any rank (or with --no-graphs) the same calls run
eagerly, and ``mode`` in the JSON says which. The ranks meet at a barrier before each sample. Reported per T:
the median over --reps samples (and p10 / p90) of rank 0's time per call. NVLink multicast stays off
(target_service.parallel.rendezvous.MULTICAST_OFF). Writes allreduce.json to --out (what `bench project --allreduce`
reads); the front door prints one line per T.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import SpecserveError

SCHEMA = "specserve.allreduce_bench/1"
JOIN_TIMEOUT_S = 600.0


class AllReduceBenchError(SpecserveError):
    """A rank failed or the arguments cannot be run."""


@dataclass(frozen=True)
class AllReduceConfig:
    """What `specserve bench kernels --suite allreduce` times (its flags)."""

    world_size: int = 4  # ranks (processes, one GPU each on CUDA)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16)  # rows T of the [T, hidden] tensor
    hidden: int = 7168  # Kimi-K2's
    vocab: int = 163840  # of the logits all-gather (0: skip it)
    reps: int = 50  # timed samples per point
    calls: int = 20  # collectives per sample (per CUDA graph)
    warmup: int = 5  # untimed eager calls per point first
    device: str = "cuda"  # cuda (NCCL) or cpu (gloo)
    no_graphs: bool = False  # time eager calls even on CUDA

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise AllReduceBenchError(f"--device: cuda or cpu for the all-reduce, got {self.device!r}")
        if not self.tokens or min(self.tokens) < 1:
            raise AllReduceBenchError("--tokens: every T must be >= 1")
        if self.world_size < 2:
            raise AllReduceBenchError(f"--world-size must be >= 2, got {self.world_size}")
        if min(self.hidden, self.reps, self.calls) < 1 or self.vocab < 0 or self.warmup < 0:
            raise AllReduceBenchError("--hidden, --reps and --calls must be >= 1; --vocab and --warmup >= 0")


def format_result(report: dict) -> str:
    lines = [f"{report['world_size']} ranks, {report['backend']}, {report['device']}; per call, median (p10-p90) us"]
    gathers = {p["tokens"]: p for p in report["all_gather_logits"]}
    for p in report["all_reduce"]:
        line = (
            f"T={p['tokens']:>3} all_reduce {p['bytes']:>8} B: {p['median_us']:.1f} "
            f"({p['p10_us']:.1f}-{p['p90_us']:.1f}) [{p['mode']}]"
        )
        g = gathers.get(p["tokens"])
        if g is not None:
            line += (
                f"; logits all_gather {g['bytes']} B/rank: {g['median_us']:.1f} ({g['p10_us']:.1f}-{g['p90_us']:.1f})"
            )
        lines.append(line)
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_samples(op, args, device, dist, torch) -> tuple[list[float], str]:
    """Per-call microseconds of `op` (one collective), one per sample, and the mode it ran in."""
    cuda = device.type == "cuda"
    for _ in range(args.warmup):
        op()
    mode = "eager"
    graph = None
    if cuda and not args.no_graphs:
        ok = torch.ones(1, device=device)
        try:
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.calls):
                    op()
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 (every rank must agree on the mode, whatever went wrong)
            print(
                f"allreduce_bench: CUDA graph capture failed ({type(exc).__name__}: {exc}); timing eager calls",
                file=sys.stderr,
            )
            graph, ok = None, torch.zeros(1, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if float(ok) == 1.0:
            mode = "cuda_graph"
        else:
            graph = None
    samples = []
    for _ in range(args.reps):
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(args.calls):
                    op()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / args.calls)
        else:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                op()
            samples.append((time.perf_counter() - t0) * 1e6 / args.calls)
    return samples, mode


def _point(tokens: int, nbytes: int, samples: list[float], mode: str) -> dict:
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "mode": mode,
        "median_us": round(statistics.median(samples), 3),
        "p10_us": round(_percentile(samples, 0.1), 3),
        "p90_us": round(_percentile(samples, 0.9), 3),
        "samples": len(samples),
    }


def _rank_main(rank: int, args: AllReduceConfig, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from specserve.target_service.parallel.rendezvous import MULTICAST_OFF

    os.environ.update(MULTICAST_OFF)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
        device_id=device if cuda else None,
    )
    try:
        reduce_points, gather_points = [], []
        gen = torch.Generator(device=device).manual_seed(rank)
        for t in args.tokens:
            x = torch.randn(t, args.hidden, generator=gen, device=device).to(torch.bfloat16)  # [T, hidden]
            samples, mode = _time_samples(lambda x=x: dist.all_reduce(x), args, device, dist, torch)
            reduce_points.append(_point(t, x.numel() * x.element_size(), samples, mode))
            if args.vocab:
                part = -(-args.vocab // args.world_size)
                local = torch.randn(t, part, generator=gen, device=device)  # [T, ceil(V / N)] float32 logits
                parts = [torch.empty_like(local) for _ in range(args.world_size)]
                samples, mode = _time_samples(lambda p=parts, v=local: dist.all_gather(p, v), args, device, dist, torch)
                gather_points.append(_point(t, local.numel() * local.element_size(), samples, mode))
        if rank == 0:
            report = {
                "schema": SCHEMA,
                "label": "measurement",
                "what": f"all_reduce of [T, {args.hidden}] bf16 and all_gather of [T, ceil({args.vocab} / N)] float32 "
                f"across N = {args.world_size} ranks of one host; rank 0's time per call",
                "world_size": args.world_size,
                "backend": dist.get_backend(),
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                "hidden": args.hidden,
                "vocab": args.vocab,
                "calls_per_sample": args.calls,
                "reps": args.reps,
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "env": {k: os.environ.get(k) for k in sorted(MULTICAST_OFF)},
                "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                "all_reduce": reduce_points,
                "all_gather_logits": gather_points,
            }
            Path(out_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    finally:
        dist.destroy_process_group()


def run(args: AllReduceConfig, out: Path) -> dict:
    """Spawn the ranks, wait for them, return rank 0's report, also in out/allreduce.json (AllReduceBenchError when
    any rank fails)."""
    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda":
        have = torch.cuda.device_count()
        if have < args.world_size:
            raise AllReduceBenchError(
                f"--world-size {args.world_size} needs {args.world_size} GPUs, this host shows {have}"
            )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "allreduce.json"
    path.unlink(missing_ok=True)
    ctx = mp.start_processes(
        _rank_main, args=(args, _free_port(), str(path)), nprocs=args.world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=5):  # raises ProcessRaisedException / ProcessExitedException when a rank fails
            if time.monotonic() > deadline:
                raise AllReduceBenchError(f"ranks still running after {JOIN_TIMEOUT_S:.0f} s")
    except mp.ProcessRaisedException as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise AllReduceBenchError(f"a rank failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise AllReduceBenchError(f"a rank exited: {exc}") from None
    finally:
        for proc in ctx.processes:  # only our own ranks, by handle
            if proc.is_alive():
                proc.terminate()
    return json.loads(path.read_text(encoding="utf-8"))
