"""Projection hook: measured step times of a larger MoE shape x the demo model's measured acceptance.

Only used when a timings file from a GPU synthetic-model run is given (``--projection-timings``);
without one the summary says so and no projection is drawn. Everything this module outputs is
labelled "projection": it combines two measurements, it is not a measurement of the larger model.
Two views: by-k curves from each drafter's per-position acceptance (``project``), and every method of
the run replayed step by step at the larger shape's step times (``project_steps``: each fixed k, and
adaptive with the k it chose), compared per drafter as in the measured run (``project_run``).

Timings file (JSON): either the ``summary.json`` of ``specserve bench step`` (or an older ``step_bench.json``) (GPU,
synthetic full-size model; the full step time with CUDA graphs, ``graph_ms``, of one model at one
context is used), or this simpler format:
    {"shape": "Qwen3-30B-A3B", "source": "<how it was measured>", "device": "<GPU name>",
     "verify_ms_by_k": {"0": 4.1, "1": 4.3, ...},      # target step with k drafted tokens (k=0: decode)
     "draft_ms_by_k": {"1": 0.2, ...}}                 # optional drafter time per step
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.result import jsonl_exists, read_jsonl
from specserve.errors import SpecserveError
from specserve.loop.verify_length import expected_emitted

LABEL = "projection"


class ProjectionError(SpecserveError):
    """The synthetic timings file is missing or malformed."""


@dataclass(frozen=True)
class ShapeTimings:
    shape: str
    source: str
    device: str
    verify_ms_by_k: Mapping[int, float]
    draft_ms_by_k: Mapping[int, float]

    def __post_init__(self) -> None:
        if 0 not in self.verify_ms_by_k:
            raise ProjectionError("verify_ms_by_k needs k=0 (plain decode) as the baseline")
        if any(v <= 0 for v in self.verify_ms_by_k.values()) or any(v < 0 for v in self.draft_ms_by_k.values()):
            raise ProjectionError("step times must be positive")


PREFERRED_MODEL = "qwen3-30b-a3b"


def timings_from_step_bench(report: dict, model: str | None = None, context: int | None = None) -> ShapeTimings:
    """One (model, context) of a step_bench.json report: default the Qwen3-30B-A3B preset if present
    (else the first model without an error) at its smallest context."""
    results = [r for r in report.get("results", []) if "error" not in r and r.get("rows")]
    if not results:
        raise ProjectionError("step_bench report holds no successful model")
    names = [r["model"] for r in results]
    if model is None:
        model = PREFERRED_MODEL if PREFERRED_MODEL in names else names[0]
    if model not in names:
        raise ProjectionError(f"step_bench report has no model {model!r}; it has {names}")
    rows = next(r for r in results if r["model"] == model)["rows"]
    # a row's "context" counts the step's own tokens too (k drafted tokens after the pending one), so
    # the rows of one sweep share context - k: group by that
    base = lambda row: int(row["context"]) - int(row["k"])  # noqa: E731
    contexts = sorted({base(row) for row in rows})
    if context is None:
        context = contexts[0]
    if context not in contexts:
        raise ProjectionError(f"step_bench report has no context {context} for {model}; it has {contexts}")
    verify = {int(row["k"]): float(row["graph_ms"]) for row in rows if base(row) == context and "graph_ms" in row}
    return ShapeTimings(
        shape=f"{model} (synthetic weights), context {context}",
        source="specserve.bench.step_bench graph_ms (full step: metadata, plan, forward, logits)",
        device=str(report.get("device_name", "")),
        verify_ms_by_k=verify,
        draft_ms_by_k={},
    )


def load_shape_timings(path: Path, model: str | None = None, context: int | None = None) -> ShapeTimings:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if "results" in raw:
            return timings_from_step_bench(raw, model, context)
        return ShapeTimings(
            shape=str(raw["shape"]),
            source=str(raw.get("source", "")),
            device=str(raw.get("device", "")),
            verify_ms_by_k={int(k): float(v) for k, v in raw["verify_ms_by_k"].items()},
            draft_ms_by_k={int(k): float(v) for k, v in (raw.get("draft_ms_by_k") or {}).items()},
        )
    except FileNotFoundError:
        raise ProjectionError(f"projection timings file {path} does not exist") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProjectionError(f"projection timings file {path} is malformed: {exc!r}") from None


def fixed_acceptance(methods: Mapping[str, dict]) -> dict[str, Sequence[float | None]]:
    """Conditional per-position acceptance of each drafter, from its fixed-k, no-draft-ahead method with
    the largest k (the one that measured the most positions); keyed by that method's name."""
    best: dict[str, tuple[int, str]] = {}
    for name, m in methods.items():
        if (
            m.get("kind") == "specserve"
            and m.get("drafter") != "none"
            and m.get("speculation") == "fixed"
            and not m.get("draft_ahead")
            and "acceptance_by_position" in m
        ):
            k = int(m.get("k") or 0)
            if m["drafter"] not in best or k > best[m["drafter"]][0]:
                best[m["drafter"]] = (k, name)
    return {name: methods[name]["acceptance_by_position"]["conditional"] for _, name in best.values()}


def project(timings: ShapeTimings, acceptance: Mapping[str, Sequence[float | None]]) -> dict:
    """Per drafter (conditional acceptance per position), projected tokens/s for each k whose step time
    was measured and whose positions' acceptance is known."""
    base_ms = timings.verify_ms_by_k[0]
    lines = {}
    for method, alpha in acceptance.items():
        known = [a for a in alpha if a is not None]
        known = known[: next((i for i, a in enumerate(alpha) if a is None), len(alpha))]
        points = []
        for k in sorted(timings.verify_ms_by_k):
            if k > len(known):
                continue
            step_ms = timings.verify_ms_by_k[k] + timings.draft_ms_by_k.get(k, 0.0)
            emitted = expected_emitted(known[:k])[-1]
            points.append(
                {
                    "k": k,
                    "expected_emitted": round(emitted, 4),
                    "step_ms": step_ms,
                    "tokens_per_s": round(emitted * 1e3 / step_ms, 3),
                }
            )
        lines[method] = points
    return {
        "label": LABEL,
        "shape": timings.shape,
        "source": timings.source,
        "device": timings.device,
        "draft_time_included": bool(timings.draft_ms_by_k),
        "baseline_tokens_per_s": round(1e3 / base_ms, 3),
        "methods": lines,
    }


def step_ms_at(timings: ShapeTimings, drafted: int) -> float | None:
    """The shape's step time with ``drafted`` tokens (+ draft time when timed): measured, or linear
    between the nearest measured k on either side; None beyond the largest measured k."""

    def at(table: Mapping[int, float], k: int) -> float | None:
        if k in table:
            return table[k]
        lo = max((x for x in table if x < k), default=None)
        hi = min((x for x in table if x > k), default=None)
        if lo is None or hi is None:
            return None
        return table[lo] + (table[hi] - table[lo]) * (k - lo) / (hi - lo)

    verify = at(timings.verify_ms_by_k, drafted)
    if verify is None:
        return None
    draft = at(timings.draft_ms_by_k, drafted) if drafted and timings.draft_ms_by_k else 0.0
    return verify + (draft or 0.0)


def project_steps(timings: ShapeTimings, methods: Mapping[str, dict], steps: Sequence[dict]) -> dict[str, dict]:
    """Every method of a run (target-only, each fixed k, adaptive, with and without draft-ahead), from
    its own measured step rows: projected time = sum over its steps of the shape's step time at that
    step's drafted count; tokens = sum of (accepted + 1). Adaptive keeps the k it chose on the measured
    model, step by step."""
    by_method: dict[str, list[dict]] = {}
    for row in steps:
        by_method.setdefault(row["method"], []).append(row)
    base = 1e3 / timings.verify_ms_by_k[0]
    out = {}
    for name, m in methods.items():
        if m.get("kind") != "specserve":
            continue
        rows = by_method.get(name, [])
        entry = {key: m.get(key) for key in ("kind", "drafter", "speculation", "draft_ahead", "k", "chosen_k")}
        entry.update({"steps": len(rows), "tokens_per_s": None})
        times = [step_ms_at(timings, int(r["drafted"])) for r in rows]
        if not rows:
            entry["reason"] = "no step rows"
        elif None in times:
            top = max(timings.verify_ms_by_k)
            entry["reason"] = f"a step drafted more tokens than the largest timed k ({top})"
        else:
            tokens = sum(int(r["accepted"]) + 1 for r in rows)
            total_ms = sum(times)
            tps = tokens * 1e3 / total_ms
            entry.update(
                {
                    "emitted": tokens,
                    "projected_ms": round(total_ms, 3),
                    "tokens_per_s": round(tps, 3),
                    "vs_target_only": round(tps / base, 4),
                }
            )
        out[name] = entry
    return out


def project_run(timings: ShapeTimings, methods: Mapping[str, dict], steps: Sequence[dict]) -> dict:
    """The whole labelled projection of a run: the by-k curves of each drafter's fixed-k acceptance,
    every method from its own steps, and adaptive against the best fixed k per drafter."""
    from specserve.bench.compare import compare_methods

    out = project(timings, fixed_acceptance(methods))
    out["per_method"] = project_steps(timings, methods, steps)
    # without draft time, a draft-ahead method projects like its plain twin: compare the plain ones only
    compared = {n: m for n, m in out["per_method"].items() if timings.draft_ms_by_k or not m.get("draft_ahead")}
    out["comparison"] = compare_methods(compared, out["baseline_tokens_per_s"], draft_ahead=False)
    out["notes"] = (
        "PROJECTION, not a measurement: the measured model's acceptance and chosen k, step by step, "
        "priced at the step times measured for " + timings.shape + ". Adaptive chose its k with "
        "the measured model's costs, not this shape's. "
        + (
            "Draft time included."
            if timings.draft_ms_by_k
            else "Draft time is not included (no drafter of this size was timed), so draft-ahead "
            "on/off is not compared here."
        )
    )
    return out


def timings_from_verify_tax(points: Sequence[dict], shape: str, source: str, device: str) -> ShapeTimings:
    """ShapeTimings from measure_verify_tax() points: the hook a synthetic-model GPU run uses (build an
    engine with the larger shape, sweep it with specserve.bench.verify_tax, then save_shape_timings)."""
    return ShapeTimings(
        shape=shape,
        source=source,
        device=device,
        verify_ms_by_k={int(p["k"]): float(p["verify_ms_median"]) for p in points},
        draft_ms_by_k={},
    )


def save_shape_timings(timings: ShapeTimings, path: Path) -> None:
    Path(path).write_text(
        json.dumps(
            {
                "shape": timings.shape,
                "source": timings.source,
                "device": timings.device,
                "verify_ms_by_k": {str(k): v for k, v in sorted(timings.verify_ms_by_k.items())},
                "draft_ms_by_k": {str(k): v for k, v in sorted(timings.draft_ms_by_k.items())},
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )


def load_run(summary_path: Path) -> tuple[dict, list[dict]]:
    """(methods, steps) of a finished bench run: its summary.json's methods (each with its k) and the steps.jsonl
    beside it ([] when absent). Raises OSError / ValueError / KeyError on a missing or malformed file."""
    summary = json.loads(Path(summary_path).read_text(encoding="utf-8"))
    methods = summary["methods"]
    k = summary.get("config", {}).get("num_speculative_tokens")
    for m in methods.values():  # runs from before --fixed-k recorded no per-method k: it was this one
        if m.get("kind") == "specserve" and "k" not in m:
            m["k"] = 0 if m.get("drafter") == "none" else k
    steps_path = Path(summary_path).parent / "steps.jsonl"
    return methods, read_jsonl(steps_path) if jsonl_exists(steps_path) else []
