"""`specserve bench e2e` (and bare `specserve bench`): the reproducible end-to-end benchmark (issue 7). Writes its
artifacts under --out; summary.json in the one schema of bench/result.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.cli.common import int_list, positive_int
from specserve.contract.speculation import DEFAULT_K
from specserve.errors import SpecserveError


def _draft_models(text: str) -> dict[str, Path]:
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        family, sep, path = item.partition("=")
        if not sep or not family.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected FAMILY=DIR[,FAMILY=DIR...], got {item!r}")
        out[family.strip()] = Path(path.strip())
    return out


_ints = int_list("integers", "integer")


def _fixed_ks(text: str) -> tuple[int, ...]:
    try:
        values = _ints(text)
    except argparse.ArgumentTypeError:
        values = ()
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers (drafted tokens per step), got {text!r}"
        )
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The e2e flags (on `specserve bench` itself too: bare `specserve bench --model ...` is e2e)."""
    from specserve.bench.config import DRAFTERS
    from specserve.cli.bench_flags import add_shared_arguments

    add_shared_arguments(
        parser,
        model_type=Path,
        out="bench_out",
        model_help="target checkpoint folder, or demo@NAME[:LAYERS] (the shipped demo at a published "
        "model's size: moonlight-16b-a3b, kimi-k2.6); default: the shipped demo",
    )
    parser.add_argument(
        "--draft-models",
        type=_draft_models,
        action="append",
        default=[],
        metavar="FAMILY=DIR",
        help="drafter checkpoints, e.g. model=DIR,eagle3=DIR (default: the shipped demo's, "
        "only when --model is not given)",
    )
    parser.add_argument(
        "--drafters",
        default=",".join(DRAFTERS),
        help=f"comma-separated drafters to run, in order (default: {','.join(DRAFTERS)})",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--num-speculative-tokens",
        "--k",
        type=positive_int,
        default=DEFAULT_K,
        help=f"draft block size k of the fixed methods when --fixed-k is not given (default {DEFAULT_K})",
    )
    parser.add_argument(
        "--fixed-k",
        type=_fixed_ks,
        default=None,
        metavar="K[,K...]",
        help="run each fixed-k method once per k, e.g. 1,2,3,4 (default: --num-speculative-tokens); "
        "adaptive caps k at the largest of these and --num-speculative-tokens",
    )
    parser.add_argument(
        "--prompts", type=positive_int, default=None, help="first N prompts of the pinned set (default: all)"
    )
    parser.add_argument(
        "--prompt-set",
        default="v1",
        help="pinned prompt set name (specserve/bench/prompts/: v1, code "
        "and docstrings; prose-v1, natural-language prose) or a .json path",
    )
    parser.add_argument("--speculation", choices=("fixed", "adaptive", "both"), default="both")
    parser.add_argument("--draft-ahead", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--k-sweep",
        type=int_list("integers", "integer"),
        default=(0, 1, 2, 3, 4, 6, 8, 12, 16),
        help="drafted-token counts of the verify-tax curve (default 0,1,2,3,4,6,8,12,16)",
    )
    parser.add_argument("--tax-context", type=positive_int, default=256, help="cached tokens for the verify-tax curve")
    parser.add_argument("--tax-repeats", type=positive_int, default=10, help="repeats per k (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests per method")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face transformers baselines")
    parser.add_argument(
        "--bandwidth-mib",
        type=positive_int,
        default=None,
        help="size of the copy that measures bandwidth (default 1024 on GPU, 256 on CPU)",
    )
    parser.add_argument("--num-kv-blocks", type=positive_int, default=4096)
    parser.add_argument("--kv-block-size", type=positive_int, default=16)
    from specserve.cli.common import add_invariant_argument

    add_invariant_argument(parser)
    parser.add_argument(
        "--projection-timings",
        type=Path,
        default=None,
        help="GPU step timings for the labelled projection line: the summary.json of "
        "`specserve bench step` (or an older step_bench.json), or the simple format of "
        "specserve/bench/projection.py",
    )
    parser.add_argument("--projection-model", default=None, help="model of a step_bench.json (default qwen3-30b-a3b)")
    parser.add_argument(
        "--projection-context",
        type=positive_int,
        default=None,
        help="context of a step_bench.json (default: its smallest)",
    )
    parser.add_argument(
        "--via",
        choices=("process", "serve"),
        default="process",
        help="serve: every method also through service processes (target + draft), once over the "
        "shared-memory data plane and once gRPC-only, beside the in-process run "
        "(per-step overhead of each in summary.json 'via' and the printed table)",
    )
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    from specserve.bench.config import BenchConfig
    from specserve.models.scaled_shapes import is_scaled_demo
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import INVARIANT_STEPS

    draft_models: dict[str, Path] = {}
    for d in args.draft_models:
        draft_models.update(d)
    both = {"both": None}
    return BenchConfig(
        model=args.model or demo_checkpoint("target"),
        out=args.out,
        draft_models=draft_models,
        demo_drafters=args.model is None or is_scaled_demo(args.model),
        drafters=tuple(d.strip() for d in args.drafters.split(",") if d.strip()),
        device=args.device,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        num_speculative_tokens=args.num_speculative_tokens,
        fixed_ks=args.fixed_k or (),
        prompt_set=args.prompt_set,
        num_prompts=args.prompts,
        speculation=("fixed", "adaptive") if args.speculation in both else (args.speculation,),
        draft_ahead=(False, True) if args.draft_ahead in both else (args.draft_ahead == "on",),
        k_sweep=args.k_sweep,
        tax_context=args.tax_context,
        tax_repeats=args.tax_repeats,
        seed=args.seed,
        warmup=args.warmup,
        hf_baselines=not args.no_hf,
        bandwidth_bytes=None if args.bandwidth_mib is None else args.bandwidth_mib << 20,
        num_kv_blocks=args.num_kv_blocks,
        kv_block_size=args.kv_block_size,
        invariant_steps=INVARIANT_STEPS[args.invariant_steps],
        projection_timings=args.projection_timings,
        projection_model=args.projection_model,
        projection_context=args.projection_context,
        plots=not args.no_plots,
        via=("process", "serve-shm", "serve-grpc") if args.via == "serve" else ("process",),
    )


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def format_table(summary: dict) -> str:
    """The Markdown table BENCHMARKS.md carries (one row per method)."""
    base = summary["methods"].get("target-only", {}).get("tokens_per_s")
    lines = [
        "| method | tok/s | vs target-only | mean accepted length | TTFT ms | step ms: wall (draft / verify / overhead)"
        " | draft ms / drafted token | floor ms | floor fraction | same output as target-only |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, m in summary["methods"].items():
        tps = m.get("tokens_per_s")
        ph = m.get("per_step_ms")
        phases = f"{ph['wall']:.2f} ({ph['draft']:.2f} / {ph['verify']:.2f} / {ph['overhead']:.2f})" if ph else "-"
        cells = [
            name,
            _fmt(tps, ".1f"),
            f"{tps / base:.2f}x" if tps and base else "-",
            _fmt(m.get("mean_accepted_length"), ".2f"),
            _fmt(m.get("ttft_s_mean"), ".1f", 1e3),
            phases,
            _fmt(m.get("draft_ms_per_drafted_token"), ".3f"),
            _fmt(ph["floor"] if ph else None, ".3f"),
            _fmt(m.get("floor_fraction_of_step"), ".3f"),
            _fmt(m.get("matches_target_only"), ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_via(via: dict) -> str:
    """In one process against the service processes (shared memory, gRPC only), per method."""
    lines = [
        "In one process against the service processes: tok/s and per-step overhead (step wall - draft - verify, ms)",
        "",
        "| method | via | tok/s | vs in-process | step ms: wall (draft / verify / overhead) | of which transport |"
        " same output |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for name, row in via.items():
        for where, r in row.items():
            ph = r.get("per_step_ms")
            phases = f"{ph['wall']:.3f} ({ph['draft']:.3f} / {ph['verify']:.3f} / {ph['overhead']:.3f})" if ph else "-"
            frac = r.get("fraction_of_process")
            transport = "-" if where == "process" or not ph else f"{ph.get('transport', 0.0):.3f}"
            lines.append(
                f"| {name} | {where} | {_fmt(r.get('tokens_per_s'), '.1f')} | "
                f"{'-' if frac is None else f'{frac:.3f}'} | {phases} | {transport} | "
                f"{_fmt(r.get('matches_target_only'), '.2f')} |"
            )
    return "\n".join(lines)


def run_e2e(args: argparse.Namespace) -> int:
    from specserve.bench.bench import run_bench
    from specserve.bench.compare import format_comparison

    if args.warmup < 0:
        raise SpecserveError(f"--warmup must be >= 0, got {args.warmup}")
    summary = run_bench(config_from_args(args), progress=not args.quiet)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    table = format_table(summary)
    blocks = [table, format_comparison(summary["comparison"], "Adaptive against the best fixed k (measured)")]
    if summary.get("via"):
        blocks.append(format_via(summary["via"]))
    projection = summary.get("projection") or {}
    if projection.get("included"):
        blocks.append(
            format_comparison(
                projection["comparison"],
                f"PROJECTION (not measured) for {projection['shape']}: adaptive against the best fixed k",
                note=projection["notes"],
            )
        )
    (args.out / "table.md").write_text("\n\n".join(blocks) + "\n")
    print("\n\n".join(blocks))
    for s in summary["skipped"]:
        print(f"skipped {s['method']}: {s['reason']}")
    print(f"artifacts: {args.out}/ (summary.json, steps.jsonl, requests.jsonl, verify_tax.jsonl, table.md, plots/)")
    return 0
