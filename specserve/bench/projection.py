"""Projection hook: measured step times of a larger MoE shape x the demo model's measured acceptance.

Only used when a timings file from a GPU synthetic-model run is given (``--projection-timings``);
without one the summary says so and no projection is drawn. Everything this module outputs is
labelled "projection": it combines two measurements, it is not a measurement of the larger model.

Timings file (JSON): either the ``step_bench.json`` of ``python -m specserve.bench.step_bench`` (GPU,
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

from specserve.errors import SpecserveError

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
    """Conditional per-position acceptance of each fixed-k, no-draft-ahead drafter method of a run."""
    return {name: m["acceptance_by_position"]["conditional"] for name, m in methods.items()
            if m.get("kind") == "specserve" and m.get("drafter") != "none" and m.get("speculation") == "fixed"
            and not m.get("draft_ahead") and "acceptance_by_position" in m}


def expected_emitted(alpha: Sequence[float], k: int) -> float:
    """E[emitted | k] = 1 + sum_{i<k} prod_{j<=i} alpha_j (alpha = conditional per-position acceptance)."""
    total, run = 1.0, 1.0
    for a in alpha[:k]:
        run *= a
        total += run
    return total


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
            emitted = expected_emitted(known, k)
            points.append({"k": k, "expected_emitted": round(emitted, 4), "step_ms": step_ms,
                           "tokens_per_s": round(emitted * 1e3 / step_ms, 3)})
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


def timings_from_verify_tax(points: Sequence[dict], shape: str, source: str, device: str) -> ShapeTimings:
    """ShapeTimings from measure_verify_tax() points: the hook a synthetic-model GPU run uses (build an
    engine with the larger shape, sweep it with specserve.bench.verify_tax, then save_shape_timings)."""
    return ShapeTimings(shape=shape, source=source, device=device,
                        verify_ms_by_k={int(p["k"]): float(p["verify_ms_median"]) for p in points}, draft_ms_by_k={})


def save_shape_timings(timings: ShapeTimings, path: Path) -> None:
    Path(path).write_text(json.dumps({
        "shape": timings.shape, "source": timings.source, "device": timings.device,
        "verify_ms_by_k": {str(k): v for k, v in sorted(timings.verify_ms_by_k.items())},
        "draft_ms_by_k": {str(k): v for k, v in sorted(timings.draft_ms_by_k.items())},
    }, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Project from a finished bench run: python -m specserve.bench.projection SUMMARY STEP_BENCH [--context N]"""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m specserve.bench.projection", description=main.__doc__)
    parser.add_argument("summary", type=Path, help="summary.json of a specserve bench run (acceptance)")
    parser.add_argument("timings", type=Path, help="step_bench.json (GPU step times of a larger shape)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        methods = json.loads(args.summary.read_text(encoding="utf-8"))["methods"]
        out = project(load_shape_timings(args.timings, args.model, args.context), fixed_acceptance(methods))
    except (OSError, ValueError, KeyError, ProjectionError) as exc:
        print(f"projection: error: {exc}", file=sys.stderr)
        return 2
    for method, points in out["methods"].items():
        if points:
            best = max(points, key=lambda p: p["tokens_per_s"])
            out.setdefault("best_fixed_k", {})[method] = {"k": best["k"], "tokens_per_s": best["tokens_per_s"]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
