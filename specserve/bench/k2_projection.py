"""A labelled projection of Kimi-K2.6 on 4 GPUs (tensor parallel 4, routed experts expert-parallel), next to the
published record. It is arithmetic on measurements, not a measurement of the model.

    specserve bench project --step STEP/summary.json --acceptance E2E/summary.json
                            [--allreduce allreduce.json] [--context 10240] [--model NAME] [--out DIR]

Inputs:
  --step        the summary.json of ``specserve bench step --shard 0/4`` (or an older step_bench.json) with one model
                at two or more layer counts (e.g. ``--model demo@kimi-k2.6:6,demo@kimi-k2.6:12``, or the synthetic
                ``kimi-k2-layer-int4:1,kimi-k2-layer-int4:4``): one rank's shard of a Kimi-K2-width model (INT4
                routed experts, 96 of 384 here; MLA heads, shared expert and lm_head split 4 ways), its collectives
                skipped. For each k, the full step time (``graph_ms``: metadata, plan,
                forward, logits) is fitted as fixed + per_layer x layers: per_layer is one decoder layer of the shard,
                the least-squares slope of the graph replays' device time (``replay_ms``) over the layer counts (of
                graph_ms where a row has no replay_ms), so the host's once-a-step work and its jitter are not
                multiplied by the layers; the fixed part (graph_ms less the layers, averaged over the layer counts)
                holds the embedding rows, final norm, the lm head shard (ceil(163840 / 4) x 7168 bf16) and the
                host's work.
  --allreduce   the allreduce.json of ``specserve bench kernels --suite allreduce --world-size 4``: per-call
                all_reduce of [T, 7168] bf16 (T = k + 1; linear between measured T) and the logits all_gather.
                Without it, PUBLISHED_ALLREDUCE below (a stated figure with its source) is used for every T.
  --acceptance  the summary.json of a ``specserve bench e2e`` run: each drafter's per-position conditional
                acceptance (its fixed-k, no-draft-ahead method with the largest k), and its steps.jsonl when beside it.

Projected step(k) = fixed(k) + LAYERS x per_layer(k) + LAYERS x ALLREDUCES_PER_LAYER x all_reduce(k + 1)
                    + logits all_gather(k + 1) (when measured).
Tokens/s per drafter and k come from specserve.bench.projection.project (E[emitted | k] / step(k)), and every
method of the acceptance run is replayed step by step (projection.project_steps) when its steps.jsonl is there.
Every printed line starts with "projection", and every key of the results (in --out's summary.json) with
"projection".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from specserve.bench.projection import (
    ProjectionError,
    ShapeTimings,
    fixed_acceptance,
    load_run,
    project,
    project_steps,
)

LAYERS = 61  # Kimi-K2.6's decoder layers (layer 0's dense MLP is priced as an MoE layer: see NOTES)
ALLREDUCES_PER_LAYER = 2  # attention o_proj, then routed + shared experts (one shared all-reduce)
TP_SIZE = 4
HIDDEN = 7168
VOCAB = 163840
PREFERRED_MODELS = ("demo@kimi-k2.6", "kimi-k2-layer-int4")  # the shard model chosen when the report has several

# The record this project measures itself against (published; not measured here).
RECORD = {
    "what": "published record, not measured here",
    "model": "Kimi-K2.6 (INT4 routed experts)",
    "hardware": "4 x NVIDIA B200",
    "tokens_per_s_single_stream": 511.6,
    "forward_ms_at_10k_context": 6.6,
    "eagle_4_token_verify_ms": [8.0, 9.3],
    "dflash_9_token_verify_ms": [11.5, 16.6],
}
# Verify widths of the record's figures as drafted tokens k (tokens in the forward = k + 1).
RECORD_WIDTHS = {0: "forward_ms_at_10k_context", 3: "eagle_4_token_verify_ms", 8: "dflash_9_token_verify_ms"}

# Used only when no --allreduce measurement is given: a published small-message figure, with its caveats.
PUBLISHED_ALLREDUCE = {
    "us_per_call": 6.0,
    "source": "NVIDIA/nccl GitHub issue #1259 (2024-04-22): nccl-tests all_reduce_perf with CUDA graphs on an HGX "
    "8 x H100 (NCCL 2.20.5, NCCL_ALGO=NVLSTree), 2 GPUs: about 6 us per all-reduce of 128 B - 64 KiB",
    "caveats": "H100 not H200, 2 ranks not 4, NVLink SHARP (multicast), which this project keeps off; one figure for "
    "every T (a [16, 7168] bf16 tensor is 224 KiB). A stand-in until allreduce_bench runs on the host.",
}

SYNTHETIC_NOTES = (
    "PROJECTION, not a measurement: one rank's shard of a Kimi-K2-width layer measured on one GPU with synthetic "
    "random weights, scaled to the model's layers, plus collectives timed apart from it.",
    "Random weights route tokens to experts unlike the real model's router does; the shard counts the experts its "
    "tokens chose among its own 96.",
)
DEMO_NOTES = (
    "PROJECTION, not a measurement: one rank's shard of the shipped demo embedded in the Kimi-K2.6 width "
    "(demo@kimi-k2.6, models/scaled_demo.py) measured on one GPU, scaled to the model's layers, plus collectives "
    "timed apart from it.",
    "The demo's layers route as the demo does (its experts and the null experts); the other layers are random "
    "layers that add nothing and route over random weights; the per-layer fit over layer counts prices mostly "
    "those. Without the collectives the shard's hidden states are its partial sums, so later layers route on them.",
)
NOTES = (
    "The model's expert parallelism gives other ranks' choices weight 0 on local expert 0 (step_bench "
    "experts_computed), so the shard reads that expert too; the real rank 0 would do the same under this code.",
    "Every layer is priced as the measured MoE layer; Kimi-K2.6's layer 0 has a dense MLP instead.",
    "Collectives are added, not overlapped: the all-reduces sit between dependent kernels of one step.",
    "The step is priced as one CUDA-graph replay per rank with the collectives inside (the shard's graph step, "
    "host work included); today's ParallelTargetEngine runs eager and sends each step's command to the workers "
    "over gloo, so it would be slower than this.",
    "Ranks 1-3 are assumed as fast as rank 0 (the slowest rank sets the step; expert load differs per rank).",
    "Draft time is not included: no drafter of this size was timed.",
    "The acceptance is that of the given bench run's drafters on their own target (e.g. the shipped demo model), "
    "not of a drafter of Kimi-K2.6.",
)


def _fail(msg: str) -> ProjectionError:
    return ProjectionError(msg)


def _read_json(path: Path, what: str) -> dict:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _fail(f"{what} file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise _fail(f"{what} file {path} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _fail(f"{what} file {path} does not hold a JSON object")
    return raw


def _base_name(spec: str) -> str:
    return spec.partition(":")[0]


def notes_for(model: str) -> tuple[str, ...]:
    """The projection's caveats for a shard of `model` (a demo@ name or a synthetic preset)."""
    return (DEMO_NOTES if model.startswith("demo@") else SYNTHETIC_NOTES) + NOTES


def _slope(pts: Sequence[tuple[int, float]]) -> float:
    """Least-squares slope of (layers, ms) points."""
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def shard_fit(report: Mapping, model: str | None = None, context: int | None = None) -> dict:
    """Fit fixed(k) + per_layer(k) x layers over the shard results of one preset at one base context.

    Returns {"model", "context", "shard", "layer_counts", "device", "lm_head_bytes", "bandwidth_bytes_per_s",
    "by_k": {k: {"fixed_ms", "per_layer_ms", "per_layer_from", "max_abs_residual_ms", "points": [[layers, graph_ms]]}}}."""
    results = [r for r in report.get("results", []) if isinstance(r, dict) and "error" not in r and r.get("rows")]
    shards = [r for r in results if r.get("shard")]
    if not shards:
        raise _fail("the step report holds no shard rows: run `specserve bench step --shard 0/4`")
    names = sorted({_base_name(r["model"]) for r in shards})
    if model is None:
        model = next((m for m in PREFERRED_MODELS if m in names), names[0])
    chosen = [r for r in shards if _base_name(r["model"]) == model]
    if not chosen:
        raise _fail(f"the step report has no shard rows of {model!r}; it has {names}")
    sizes = {(r["shard"]["rank"], r["shard"]["size"]) for r in chosen}
    if len(sizes) != 1:
        raise _fail(f"the shard rows of {model} mix shards {sorted(sizes)}; give one rank of one split")
    by_layers = {}
    for r in chosen:
        by_layers[int(r["layers"])] = r
    if len(by_layers) < 2:
        raise _fail(
            f"the shard rows of {model} have one layer count ({sorted(by_layers)}); `bench step` needs two or "
            f"more (e.g. --models {model}:1,{model}:4) to separate the per-layer step from the fixed part"
        )

    def base(row: Mapping) -> int:  # step_bench's --contexts value: the tokens the decode step attends over
        return int(row["context"]) - int(row["k"]) + 1

    common = set.intersection(*({base(row) for row in r["rows"]} for r in by_layers.values()))
    if not common:
        raise _fail(f"the shard rows of {model} share no context across layer counts {sorted(by_layers)}")
    if context is None:
        context = max(common)
    if context not in common:
        raise _fail(
            f"the shard rows of {model} have no context {context} at every layer count; they share {sorted(common)}"
        )
    times: dict[int, list[tuple[int, float]]] = {}
    replays: dict[int, list[tuple[int, float]]] = {}
    for layers, r in sorted(by_layers.items()):
        for row in r["rows"]:
            if base(row) == context and "graph_ms" in row:
                times.setdefault(int(row["k"]), []).append((layers, float(row["graph_ms"])))
                if "replay_ms" in row:
                    replays.setdefault(int(row["k"]), []).append((layers, float(row["replay_ms"])))
    by_k = {}
    for k, pts in sorted(times.items()):
        if len(pts) < 2:
            continue
        # a layer is device work: its slope comes from the graph replays when every point has one, and the host's
        # work (once a step, with its jitter) stays in the fixed part instead of being multiplied by the layers
        device = replays.get(k, [])
        slope_pts, slope_from = (device, "replay_ms") if len(device) == len(pts) else (pts, "graph_ms")
        slope = _slope(slope_pts)
        if slope <= 0:
            raise _fail(
                f"the shard step of {model} does not grow with layers at k = {k} (points {slope_pts}): the rows "
                "are too noisy to project; rerun `specserve bench step` with more --reps or layer counts further apart"
            )
        fixed = sum(y - slope * x for x, y in pts) / len(pts)
        residual = max(abs(y - fixed - slope * x) for x, y in pts)  # 0 with two graph_ms fits; a check otherwise
        by_k[k] = {
            "fixed_ms": fixed,
            "per_layer_ms": slope,
            "per_layer_from": slope_from,
            "max_abs_residual_ms": residual,
            "points": [list(p) for p in pts],
        }
    if 0 not in by_k:
        raise _fail(f"the shard rows of {model} have no decode (k = 0) step at context {context}")
    first = next(iter(by_layers.values()))
    return {
        "model": model,
        "context": context,
        "shard": dict(first["shard"]),
        "layer_counts": sorted(by_layers),
        "device": str(report.get("device_name") or ""),
        "lm_head_bytes": first.get("lm_head_bytes"),
        "bandwidth_bytes_per_s": (report.get("bandwidth") or {}).get("bytes_per_s"),
        "by_k": by_k,
    }


def _at(points: Mapping[int, float], t: int) -> float | None:
    """Linear between the nearest measured T on either side; None outside the measured range."""
    if t in points:
        return points[t]
    lo = max((x for x in points if x < t), default=None)
    hi = min((x for x in points if x > t), default=None)
    if lo is None or hi is None:
        return None
    return points[lo] + (points[hi] - points[lo]) * (t - lo) / (hi - lo)


class Collectives:
    """Per-call collective costs by T, in microseconds: measured (allreduce.json) or the published figure."""

    def __init__(self, report: Mapping | None, tp_size: int, hidden: int = HIDDEN) -> None:
        if report is None:
            self.source = "published: " + PUBLISHED_ALLREDUCE["source"]
            self.caveats = PUBLISHED_ALLREDUCE["caveats"]
            self.reduce_us = None
            self.gather_us: dict[int, float] = {}
            self.mode = "published figure"
            return
        try:
            world, width = int(report["world_size"]), int(report["hidden"])
            self.reduce_us = {int(p["tokens"]): float(p["median_us"]) for p in report["all_reduce"]}
            self.gather_us = {int(p["tokens"]): float(p["median_us"]) for p in report.get("all_gather_logits") or []}
            modes = sorted({str(p.get("mode")) for p in report["all_reduce"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise _fail(f"the allreduce report is malformed: {exc!r}") from None
        if world != tp_size:
            raise _fail(f"the allreduce report has {world} ranks; the shard rows are one of {tp_size}")
        if width != hidden:
            raise _fail(f"the allreduce report reduced [T, {width}]; the model's hidden size is {hidden}")
        if not self.reduce_us or any(v <= 0 for v in self.reduce_us.values()):
            raise _fail("the allreduce report holds no positive all_reduce times")
        self.source = (
            f"measured: specserve.bench.allreduce_bench, {world} ranks, {report.get('backend')}, "
            f"{report.get('device')}, {report.get('date_utc')}"
        )
        self.caveats = ""
        self.mode = ", ".join(modes)

    def all_reduce_us(self, t: int) -> float | None:
        if self.reduce_us is None:
            return PUBLISHED_ALLREDUCE["us_per_call"]
        return _at(self.reduce_us, t)

    def gather_logits_us(self, t: int) -> float | None:
        return _at(self.gather_us, t) if self.gather_us else 0.0


def project_steps_ms(fit: Mapping, collectives: Collectives, layers: int = LAYERS) -> tuple[dict, list[str]]:
    """{k: breakdown} of the projected full-model step, and notes on the k left out."""
    out, dropped = {}, []
    for k, f in fit["by_k"].items():
        ar = collectives.all_reduce_us(k + 1)
        gather = collectives.gather_logits_us(k + 1)
        if ar is None or gather is None:
            dropped.append(f"k = {k}: no collective time measured at T = {k + 1}")
            continue
        layers_ms = layers * f["per_layer_ms"]
        ar_ms = layers * ALLREDUCES_PER_LAYER * ar / 1e3
        total = f["fixed_ms"] + layers_ms + ar_ms + gather / 1e3
        out[k] = {
            "tokens": k + 1,
            "fixed_ms": round(f["fixed_ms"], 4),
            "per_layer_ms": round(f["per_layer_ms"], 4),
            "layers_ms": round(layers_ms, 4),
            "all_reduce_us_per_call": round(ar, 3),
            "all_reduce_ms": round(ar_ms, 4),
            "logits_all_gather_ms": round(gather / 1e3, 4),
            "step_ms": round(total, 4),
        }
    return out, dropped


def build(
    shard_report: Mapping,
    allreduce_report: Mapping | None,
    methods: Mapping,
    steps: Sequence[dict],
    model: str | None = None,
    context: int | None = None,
) -> dict:
    """The whole labelled projection (every key starts with "projection")."""
    fit = shard_fit(shard_report, model, context)
    collectives = Collectives(allreduce_report, fit["shard"]["size"])
    step_ms, dropped = project_steps_ms(fit, collectives)
    if 0 not in step_ms:
        raise _fail("no collective time for T = 1: the allreduce report must measure --tokens 1")
    timings = ShapeTimings(
        shape=f"Kimi-K2.6 ({LAYERS} layers) on {fit['shard']['size']} GPUs, projected from {fit['model']} shard "
        f"{fit['shard']['rank']}/{fit['shard']['size']}, context {fit['context']}",
        source="specserve.bench.k2_projection: fixed + layers x per-layer shard step + collectives",
        device=fit["device"],
        verify_ms_by_k={k: v["step_ms"] for k, v in step_ms.items()},
        draft_ms_by_k={},
    )
    acceptance = fixed_acceptance(methods)
    if not acceptance:
        raise _fail("the acceptance summary has no fixed-k drafter method with per-position acceptance")
    curves = project(timings, acceptance)
    best = {}
    for name, points in curves["methods"].items():
        if points:
            top = max(points, key=lambda p: p["tokens_per_s"])
            best[name] = {"k": top["k"], "tokens_per_s": top["tokens_per_s"]}
    lm_floor = None
    if fit["lm_head_bytes"] and fit["bandwidth_bytes_per_s"]:
        lm_floor = round(fit["lm_head_bytes"] / fit["bandwidth_bytes_per_s"] * 1e3, 4)
    record_vs = {}
    for k, key in RECORD_WIDTHS.items():
        if k in step_ms:
            record_vs[f"k{k}_tokens_{k + 1}"] = {"projection_step_ms": step_ms[k]["step_ms"], "record": RECORD[key]}
    out = {
        "projection_label": "PROJECTION, not a measurement",
        "projection_notes": list(notes_for(fit["model"]))
        + ([collectives.caveats] if collectives.caveats else [])
        + dropped,
        "projection_inputs": {
            "shard_model": fit["model"],
            "shard": fit["shard"],
            "layer_counts": fit["layer_counts"],
            "context": fit["context"],
            "device": fit["device"],
            "step_time": "step_bench graph_ms",
            "collectives": collectives.source,
            "collective_mode": collectives.mode,
            "acceptance_methods": sorted(acceptance),
        },
        "projection_model": {
            "layers": LAYERS,
            "tp_size": fit["shard"]["size"],
            "all_reduces_per_layer": ALLREDUCES_PER_LAYER,
            "hidden": HIDDEN,
            "vocab": VOCAB,
            "lm_head_shard_bytes": fit["lm_head_bytes"],
            "lm_head_shard_floor_ms": lm_floor,
        },
        "projection_fit": {str(k): v for k, v in fit["by_k"].items()},
        "projection_step_ms_by_k": {str(k): v for k, v in step_ms.items()},
        "projection_target_only_tokens_per_s": curves["baseline_tokens_per_s"],
        "projection_tokens_per_s_by_k": curves["methods"],
        "projection_best_k": best,
        "projection_vs_record": record_vs,
        "projection_reference_record": RECORD,
    }
    if steps:
        out["projection_per_method"] = project_steps(timings, methods, steps)
    return out


def format_lines(p: Mapping) -> list[str]:
    """The printed report: every line starts with "projection"."""
    inp, model = p["projection_inputs"], p["projection_model"]
    lines = [
        f"projection | {p['projection_label']}: Kimi-K2.6, {model['layers']} layers, TP {model['tp_size']} (routed "
        f"experts EP), from shard {inp['shard']['rank']}/{inp['shard']['size']} of {inp['shard_model']} at layer "
        f"counts {inp['layer_counts']}, context {inp['context']}, on {inp['device'] or 'an unnamed device'}",
        f"projection | collectives: {inp['collectives']} [{inp['collective_mode']}]",
        "projection | step ms by drafted k = fixed + layers x per-layer + all-reduces + logits gather",
    ]
    for k, s in p["projection_step_ms_by_k"].items():
        lines.append(
            f"projection |   k={k:>2} ({s['tokens']:>2} tokens): {s['step_ms']:.3f} = {s['fixed_ms']:.3f} + "
            f"{model['layers']} x {s['per_layer_ms']:.4f} + {model['layers'] * model['all_reduces_per_layer']}"
            f" x {s['all_reduce_us_per_call']:.1f} us + {s['logits_all_gather_ms']:.3f}"
        )
    lines.append(f"projection | target-only (k = 0): {p['projection_target_only_tokens_per_s']:.1f} tok/s")
    for name, points in p["projection_tokens_per_s_by_k"].items():
        curve = " ".join(f"k{q['k']}: {q['tokens_per_s']:.1f}" for q in points)
        best = p["projection_best_k"].get(name)
        tail = f" | best k = {best['k']}: {best['tokens_per_s']:.1f} tok/s" if best else ""
        lines.append(f"projection | {name} acceptance: {curve}{tail}")
    rec = p["projection_reference_record"]
    lines.append(
        f"projection | published record (not ours, {rec['hardware']}): {rec['tokens_per_s_single_stream']} "
        f"tok/s single-stream; forward {rec['forward_ms_at_10k_context']} ms at 10k context; EAGLE 4-token "
        f"verify {rec['eagle_4_token_verify_ms'][0]}-{rec['eagle_4_token_verify_ms'][1]} ms; DFlash 9-token "
        f"verify {rec['dflash_9_token_verify_ms'][0]}-{rec['dflash_9_token_verify_ms'][1]} ms"
    )
    for width, v in p["projection_vs_record"].items():
        r = v["record"]
        r_txt = f"{r[0]}-{r[1]}" if isinstance(r, list) else f"{r}"
        lines.append(f"projection |   {width}: projected {v['projection_step_ms']:.3f} ms vs record {r_txt} ms")
    for note in p["projection_notes"]:
        lines.append(f"projection | note: {note}")
    return lines


def run_projection(
    step: Path, acceptance: Path, allreduce: Path | None = None, model: str | None = None, context: int | None = None
) -> dict:
    """The projection from the files the front door names (a bad or missing file: a ProjectionError naming it)."""
    shard = _read_json(step, "--step")
    collectives = _read_json(allreduce, "--allreduce") if allreduce is not None else None
    if not Path(acceptance).is_file():
        raise _fail(f"--acceptance file {acceptance} does not exist")
    try:
        methods, steps = load_run(acceptance)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _fail(f"--acceptance file {acceptance} is not a bench summary.json: {exc!r}") from None
    try:
        return build(shard, collectives, methods, steps, model, context)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field of the right file has the wrong shape
        raise _fail(f"an input file is malformed: {exc!r}") from None
