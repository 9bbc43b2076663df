"""`specserve bench`: the one front door of the benchmarks.

    specserve bench [e2e] ...     end to end: every method on the pinned prompts (bare `specserve bench` is e2e)
    specserve bench step ...      one target step against its bytes floor (--shard R/N: one rank's shard;
                                  --census: the kernels of a step)
    specserve bench kernels ...   the MoE / attention / quantized kernels against their floors (GPU)
    specserve bench draft ...     where a drafter's time goes (bench/draft_profile.py)
    specserve bench overhead ...  per-step orchestration overhead: in process, over shared memory, gRPC only
    specserve bench project ...   the labelled Kimi-K2.6 projection from a step shard and an e2e run's acceptance
    specserve bench headline ...  every row of BENCHMARKS.md's GPU headline, one H200, ~6 min (make bench-h200)

Every subcommand takes the shared flags that apply to it (bench_flags.py: --model, --device, --dtype, --out, --seed,
--json) and writes --out/summary.json in one schema (bench/result.py: the environment, commit and source hash,
then its own results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.cli import bench_e2e
from specserve.cli.bench_flags import add_shared_arguments, name_list, shard_arg
from specserve.cli.common import MODEL_HELP, int_list, positive_int
from specserve.contract.speculation import DEFAULT_K
from specserve.errors import SpecserveError

_ints = int_list("integers", "integer")
STEP_MODELS = ("qwen3-30b-a3b", "kimi-k2-layer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specserve.cli.common import add_invariant_argument

    bench_e2e.add_arguments(parser)  # bare `specserve bench --model ...` runs e2e
    # no abbreviations at this level: a subcommand's own flag (overhead's --n) would be read here as a prefix of
    # e2e's (--num-kv-blocks, --no-hf, ...) before the subcommand's parser sees it
    parser.allow_abbrev = False
    sub = parser.add_subparsers(dest="bench_command", metavar="WHAT", parser_class=type(parser))

    bench_e2e.add_arguments(sub.add_parser("e2e", help="end to end: every method on the pinned prompts (default)"))

    p = sub.add_parser("step", help="one target step's time against its bytes floor (GPU; CPU with --no-graphs)")
    add_shared_arguments(
        p,
        out="bench_out/step",
        device="cuda",
        dtype="bfloat16",
        model_help="comma-separated model names: demo@NAME[:LAYERS], synthetic:NAME[:LAYERS] or a "
        "bare preset NAME[:LAYERS] (synthetic); default "
        f"{','.join(STEP_MODELS)} (--census: demo,synthetic:qwen3-30b-a3b)",
    )
    p.add_argument("--models", dest="model", help=argparse.SUPPRESS)  # the name step_bench took
    p.add_argument(
        "--contexts",
        type=_ints,
        default=None,
        help="cached tokens before the step, comma-separated (default 128,4096; --census: 512)",
    )
    p.add_argument("--max-k", type=int, default=16, help="largest number of drafted tokens")
    p.add_argument("--reps", type=positive_int, default=20, help="timed steps per point with CUDA graphs")
    p.add_argument("--eager-reps", type=int, default=3, help="timed eager steps per point (0: skip eager)")
    p.add_argument("--kv-block-size", "--block-size", type=positive_int, default=16)
    p.add_argument("--no-graphs", action="store_true", help="eager only (CPU smoke runs)")
    add_invariant_argument(p)
    p.add_argument(
        "--shard",
        type=shard_arg,
        default=None,
        metavar="R/N",
        help="time only rank R of an N-way TP shard (routed experts EP), collectives skipped",
    )
    p.add_argument(
        "--census",
        action="store_true",
        help="count the kernels of a step instead (bench/step_profile.py): --k, --modes, --steps",
    )
    p.add_argument("--k", type=_ints, default=(0, 3), help="--census: drafted tokens per step")
    p.add_argument(
        "--modes",
        type=name_list,
        default=("auto",),
        help="--census: engine modes (auto, skinny, triton, unfused, eager)",
    )
    p.add_argument("--steps", type=positive_int, default=20, help="--census: profiled steps per point")
    p.add_argument("--host-profile", action="store_true", help="--census: also cProfile the host side")

    p = sub.add_parser("kernels", help="MoE, attention, quantized kernels and collectives against their floors (GPU)")
    add_shared_arguments(p, out="bench_out/kernels", device="cuda", dtype=None, seed=False)
    p.add_argument(
        "--suite",
        type=name_list,
        default=("moe", "quant"),
        help="moe (fused MoE and attention: bench/kernel_bench.py), quant (W4A16 / FP8: "
        "bench/quant_kernel_bench.py), allreduce (the TP collectives over --world-size ranks: "
        "bench/allreduce_bench.py; gloo with --device cpu; writes allreduce.json for project)",
    )
    p.add_argument("--quick", action="store_true", help="moe, quant: decode token counts only, no config sweep")
    p.add_argument(
        "--gemv-sweep",
        action="store_true",
        help="quant: sweep the W4A16 GEMV's tile at Kimi-K2.6 width instead (bench/gemv_sweep.py: every "
        "tile checked, then timed; best per kernel)",
    )
    p.add_argument("--world-size", type=int, default=4, help="allreduce: ranks (one GPU each on CUDA)")
    p.add_argument("--tokens", type=_ints, default=(1, 2, 4, 8, 16), help="allreduce: rows T of [T, hidden]")
    p.add_argument("--hidden", type=int, default=7168, help="allreduce: hidden size (Kimi-K2: 7168)")
    p.add_argument("--vocab", type=int, default=163840, help="allreduce: vocabulary of the logits all-gather (0: skip)")
    p.add_argument("--reps", type=int, default=50, help="allreduce: timed samples per point")
    p.add_argument("--calls", type=int, default=20, help="allreduce: collectives per sample (per CUDA graph)")
    p.add_argument("--warmup", type=int, default=5, help="allreduce: untimed eager calls per point first")
    p.add_argument("--no-graphs", action="store_true", help="allreduce: time eager calls even on CUDA")

    p = sub.add_parser("draft", help="where each drafter's time goes (bench/draft_profile.py)")
    add_shared_arguments(
        p,
        out="bench_out/draft",
        model_default="demo",
        seed=False,
        model_help="demo, or demo@NAME[:LAYERS] (its drafters scaled to that target)",
    )
    p.add_argument("--drafters", default=None, help="comma-separated drafter families (default: draft_profile's)")
    p.add_argument(
        "--k", "--num-speculative-tokens", type=positive_int, default=DEFAULT_K, help="drafted tokens per propose"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--top", type=positive_int, default=15, help="host functions listed per drafter")

    p = sub.add_parser("overhead", help="per-step orchestration overhead: in process, shared memory, gRPC only")
    add_shared_arguments(p, out="bench_out/overhead", model_help=MODEL_HELP)
    p.add_argument("--drafters", type=name_list, default=("none", "ngram"), help="none and / or ngram")
    vias = "process,process-hops,gateway-shm,serve-shm,serve-grpc"  # no served via: no service process starts
    p.add_argument("--vias", type=name_list, default=tuple(vias.split(",")), help=f"of {vias}; process always")
    p.add_argument(
        "--k",
        "--num-speculative-tokens",
        type=positive_int,
        default=DEFAULT_K,
        help="drafted tokens per step of a drafter method",
    )
    p.add_argument("--requests", type=positive_int, default=3, help="prompts per method, via and round")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds over every method and via")
    p.add_argument("--deadline-s", type=float, default=120.0, help="each served request's deadline")
    p.add_argument(
        "--ring",
        action="store_true",
        help="the transports alone instead: one small message's round trip through the shared-memory "
        "ring against a gRPC unix-socket stream (bench/ring_rtt.py): --bytes, --n, --warmup, --spin-us",
    )
    p.add_argument(
        "--chooser",
        action="store_true",
        help="the adaptive chooser's host time a step instead, no model (bench/chooser_cost.py): --n steps",
    )
    p.add_argument("--bytes", type=positive_int, default=200, help="--ring: message size")
    p.add_argument("--n", type=positive_int, default=3000, help="--ring: timed round trips per transport")
    p.add_argument("--warmup", type=int, default=300, help="--ring: untimed round trips first")
    p.add_argument("--spin-us", type=float, default=20.0, help="--ring: the spinning variants' spin (us)")

    from specserve.cli import bench_headline

    bench_headline.add_arguments(
        sub.add_parser(
            "headline", help="every row of BENCHMARKS.md's GPU headline table, one H200, ~6 min (bench/headline.py)"
        )
    )

    p = sub.add_parser("project", help="the labelled Kimi-K2.6 projection (bench/k2_projection.py; no device)")
    add_shared_arguments(
        p,
        out="bench_out/project",
        device=None,
        dtype=None,
        seed=False,
        model_help="which model of the step rows (default demo@kimi-k2.6, else kimi-k2-layer-int4, when present)",
    )
    p.add_argument(
        "--step",
        "--shard-step",
        type=Path,
        required=True,
        help="summary.json of `specserve bench step --shard 0/4` (or an older step_bench.json)",
    )
    p.add_argument("--acceptance", type=Path, required=True, help="summary.json of a `specserve bench e2e` run")
    p.add_argument(
        "--allreduce",
        type=Path,
        default=None,
        help="allreduce.json of `specserve bench kernels --suite allreduce --world-size 4`",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="which of the step's contexts (default the largest; --shape: the smallest)",
    )
    p.add_argument(
        "--shape",
        action="store_true",
        help="project onto the step's own model instead (bench/projection.py: every method of the e2e run "
        "replayed at its step times), not Kimi-K2.6 on 4 GPUs",
    )


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _finish(args: argparse.Namespace, bench: str, config, env: dict, results: dict, table: str) -> dict:
    from specserve.bench.result import make_summary, write_summary

    summary = make_summary(bench, config, env, results)
    write_summary(args.out, summary)
    print(json.dumps(summary, indent=2, default=str) if args.json else table)
    if not args.json:
        print(f"artifacts: {args.out}/summary.json")
    return summary


def _run_step(args: argparse.Namespace) -> int:
    from specserve.bench.environment import environment
    from specserve.bench.result import make_summary, write_summary

    if args.census:
        return _run_census(args)
    from specserve.bench import step_bench
    from specserve.target_service.factory import INVARIANT_STEPS

    _check_device(args.device)
    cfg = step_bench.StepBenchConfig(
        models=tuple(name_list(args.model)) if args.model else STEP_MODELS,
        contexts=args.contexts or (128, 4096),
        max_k=args.max_k,
        reps=args.reps,
        eager_reps=args.eager_reps,
        device=args.device,
        dtype=args.dtype,
        block_size=args.kv_block_size,
        no_graphs=args.no_graphs,
        shard=args.shard,
        seed=args.seed,
        invariant_steps=INVARIANT_STEPS[args.invariant_steps],
    )
    env = environment(cfg.device)

    def save(report: dict) -> None:
        env["bandwidth"] = report["bandwidth"]
        write_summary(args.out, make_summary("step", cfg, env, report))
        (args.out / "step_bench.md").write_text(step_bench.format_table(report["results"], bw(report)) + "\n")

    def bw(report: dict) -> float:
        return report["bandwidth"]["bytes_per_s"]

    report = step_bench.run_step_bench(cfg, _log, save)
    _finish(args, "step", cfg, env, report, step_bench.format_table(report["results"], bw(report)))
    return 0 if all("error" not in r for r in report["results"]) else 1


def _run_census(args: argparse.Namespace) -> int:
    from specserve.bench import step_profile
    from specserve.bench.environment import environment
    from specserve.target_service.factory import INVARIANT_STEPS

    _check_device(args.device)
    contexts = args.contexts or (512,)
    cfg = step_profile.CensusConfig(
        models=tuple(name_list(args.model)) if args.model else step_profile.DEFAULT_MODELS,
        k=args.k,
        modes=args.modes,
        context=contexts[0],
        steps=args.steps,
        host_profile=args.host_profile,
        device=args.device,
        dtype=args.dtype,
        invariant_steps=INVARIANT_STEPS[args.invariant_steps],
    )
    env = environment(cfg.device)
    result = step_profile.run_census(cfg)
    env["bandwidth"] = result["bandwidth"]
    _finish(args, "step-census", cfg, env, result, step_profile.format_rows(result["rows"]))
    return 0


def _run_kernels(args: argparse.Namespace) -> int:
    from specserve.bench.environment import environment

    suites = {
        "moe": "specserve.bench.kernel_bench",
        "quant": "specserve.bench.quant_kernel_bench",
        "allreduce": "specserve.bench.allreduce_bench",
    }
    unknown = [s for s in args.suite if s not in suites]
    if unknown:
        raise SpecserveError(f"--suite: choose from {', '.join(suites)}, got {','.join(args.suite)}")
    if args.gemv_sweep:
        if "quant" not in args.suite:
            raise SpecserveError(f"--gemv-sweep runs in the quant suite; got --suite {','.join(args.suite)}")
        suites["quant"] = "specserve.bench.gemv_sweep"
    kernels = [s for s in args.suite if s != "allreduce"]
    _check_device(args.device, needs_cuda="bench kernels times Triton and FlashInfer kernels" if kernels else None)
    import importlib

    from specserve.bench import allreduce_bench

    collectives = None
    if "allreduce" in args.suite:  # checked before anything runs
        collectives = allreduce_bench.AllReduceConfig(
            world_size=args.world_size,
            tokens=args.tokens,
            hidden=args.hidden,
            vocab=args.vocab,
            reps=args.reps,
            calls=args.calls,
            warmup=args.warmup,
            device=args.device.partition(":")[0],
            no_graphs=args.no_graphs,
        )
    env = environment(args.device)
    results, tables = {}, []
    for name in args.suite:
        if name == "allreduce":
            results[name] = allreduce_bench.run(collectives, args.out)
            tables.append(allreduce_bench.format_result(results[name]) + f"\nwrote {args.out / 'allreduce.json'}")
            continue
        module = importlib.import_module(suites[name])
        results[name] = module.run(quick=args.quick, log=_log)
        tables.append(module.format_result(results[name]))
        env["bandwidth"] = {"bytes_per_s": results[name]["copy_bandwidth_Bps"]}
    config = {
        "suite": args.suite,
        "quick": args.quick,
        "gemv_sweep": args.gemv_sweep,
        "device": args.device,
        "allreduce": collectives,
    }
    _finish(args, "kernels", config, env, {"suites": results}, "\n\n".join(tables))
    return 0


def _run_draft(args: argparse.Namespace) -> int:
    from specserve.bench import draft_profile
    from specserve.bench.environment import environment

    # checked here, each in one line, before anything loads
    if args.drafters:
        bad = [f for f in name_list(args.drafters) if f not in draft_profile.DRAFTERS]
        if bad:
            raise SpecserveError(f"--drafters: choose from {', '.join(draft_profile.DRAFTERS)}, got {args.drafters!r}")
    if args.max_new_tokens < 2:
        raise SpecserveError(f"--max-new-tokens must be >= 2 for bench draft, got {args.max_new_tokens}")
    _check_device(args.device)
    if args.model != "demo":
        from specserve.models.errors import ModelConfigError
        from specserve.models.model_names import resolve_model

        try:
            resolve_model(args.model)
        except ModelConfigError as exc:
            raise SpecserveError(f"--model {args.model}: {exc}") from None
    rows_path = args.out / "draft_profile.json"
    env = environment(args.device)
    rc = draft_profile.run(
        draft_profile.ProfileConfig(  # it profiles, prints and writes its rows
            model=args.model,
            drafters=name_list(args.drafters) if args.drafters else draft_profile.DEFAULT_DRAFTERS,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            device=args.device,
            dtype=args.dtype,
            top=args.top,
            out=rows_path,
        )
    )
    if rc:
        return rc
    config = {
        "model": args.model,
        "drafters": args.drafters,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "top": args.top,
    }
    rows = json.loads(rows_path.read_text(encoding="utf-8"))["rows"]
    _finish(args, "draft", config, env, {"rows": rows}, f"rows: {rows_path}")
    return 0


def _run_overhead(args: argparse.Namespace) -> int:
    from specserve.bench import serve_overhead
    from specserve.bench.environment import environment
    from specserve.paths import demo_checkpoint

    if args.ring:
        return _run_ring(args)
    if args.chooser:
        return _run_chooser(args)
    cfg = serve_overhead.OverheadConfig(
        model=args.model or str(demo_checkpoint("target")),
        device=args.device,
        dtype=args.dtype,
        drafters=args.drafters,
        vias=args.vias,
        k=args.k,
        requests=args.requests,
        max_new_tokens=args.max_new_tokens,
        rounds=args.rounds,
        deadline_s=args.deadline_s,
        seed=args.seed,
    )
    env = environment(cfg.device)
    result = serve_overhead.run(cfg)
    _finish(args, "overhead", cfg, env, result, serve_overhead.table(result))
    return 0


def _run_ring(args: argparse.Namespace) -> int:
    from specserve.bench import ring_rtt
    from specserve.bench.environment import environment

    config = {"bytes": args.bytes, "n": args.n, "warmup": args.warmup, "spin_us": args.spin_us}
    env = environment("cpu")
    results = ring_rtt.run(args.bytes, args.n, args.warmup, args.spin_us)
    _finish(
        args, "overhead-ring", config, env, {"results": results}, ring_rtt.format_result(results, args.bytes, args.n)
    )
    return 0


def _run_chooser(args: argparse.Namespace) -> int:
    from specserve.bench import chooser_cost
    from specserve.bench.environment import environment

    config = {"steps": args.n, "max_k": args.k, "seed": args.seed}
    result = chooser_cost.run(args.n, args.k, seed=args.seed)
    _finish(args, "overhead-chooser", config, environment("cpu"), {"parts": result}, chooser_cost.table(result))
    return 0


def _run_project(args: argparse.Namespace) -> int:
    from specserve.bench import k2_projection
    from specserve.bench.environment import environment

    config = {
        "step": args.step,
        "acceptance": args.acceptance,
        "allreduce": args.allreduce,
        "model": args.model,
        "context": args.context,
        "shape": args.shape,
    }
    if args.shape:
        from specserve.bench.compare import format_comparison
        from specserve.bench.projection import load_run, load_shape_timings, project_run

        try:
            methods, steps = load_run(args.acceptance)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SpecserveError(f"--acceptance file {args.acceptance} is not an e2e summary.json: {exc!r}") from None
        result = {"projection": project_run(load_shape_timings(args.step, args.model, args.context), methods, steps)}
        p = result["projection"]
        table = format_comparison(
            p["comparison"],
            f"PROJECTION (not measured) for {p['shape']}: adaptive against the best fixed k",
            note=p["notes"],
        )
        _finish(args, "project-shape", config, environment("cpu"), result, table)
        return 0
    result = k2_projection.run_projection(args.step, args.acceptance, args.allreduce, args.model, args.context)
    _finish(args, "project", config, environment("cpu"), result, "\n".join(k2_projection.format_lines(result)))
    return 0


def _check_device(device: str, needs_cuda: str | None = None) -> None:
    import torch

    if needs_cuda and not device.startswith("cuda"):
        raise SpecserveError(f"--device {device}: {needs_cuda}; it needs --device cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecserveError(f"--device {device}: no CUDA device here (torch.cuda.is_available() is false)")


def _run_headline(args: argparse.Namespace) -> int:
    from specserve.cli.bench_headline import run_headline

    return run_headline(args)


RUNNERS = {
    "e2e": bench_e2e.run_e2e,
    "step": _run_step,
    "kernels": _run_kernels,
    "draft": _run_draft,
    "overhead": _run_overhead,
    "project": _run_project,
    "headline": _run_headline,
}


def run(args: argparse.Namespace) -> int:
    from specserve.bench.quiet import silence_library_bars

    silence_library_bars()  # Hugging Face's bars would interleave with ours
    return RUNNERS[args.bench_command or "e2e"](args)
