"""BENCHMARKS.md's GPU headline in one command: `specserve bench headline` (or `make bench-h200`).

Every row of the headline table, each a `specserve bench` run of its own (its own process, so each frees the GPU for
the next), on one H200 in about 6 minutes (329 s of stages on 2026-12-03):

    moon-a, moon-b   demo@moonlight-16b-a3b, every drafter at k = 1, 2, 4 and adaptive, in process, through serve over
                     shared memory and over gRPC only (two runs: the two stacks of one run hold two targets)
    k26              demo@kimi-k2.6:6 (K2.6's width, int4 experts), every drafter in process
    k26-serve-a, -b  the same through serve, at k = 1, 2 and adaptive (n-gram and EAGLE-3, then the draft LM; DFlash
                     and MTP lose in process at this width, and all of them at once do not fit beside the stacks)
    census           the kernels of a decode and a 4-token verify, Moonlight and K2.6 width (12 layers)
    k26-shard        one rank's shard of a 4-way K2.6 split at 6 and 12 layers, context 10240
    k26-projection   Kimi-K2.6 on 4 GPUs, PROJECTED from the shard and the k26 run's acceptance (no device)

The stages' summaries stay under OUT/<stage>/ (BENCHMARKS.md's artifacts); `headline_table` reads them back into the
table, written to OUT/headline.md and printed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MOONLIGHT = "demo@moonlight-16b-a3b"
K26 = "demo@kimi-k2.6:6"
_E2E = (
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--draft-ahead",
    "off",
    "--speculation",
    "both",
    "--no-hf",
    "--no-plots",
)


@dataclass(frozen=True)
class Stage:
    """One run of the headline: its name (its folder under OUT) and its `specserve` arguments."""

    name: str
    argv: tuple[str, ...]
    what: str


def stages(out: Path) -> list[Stage]:
    """The headline's runs, in order (the projection reads the shard's and k26's summaries)."""

    def e2e(name: str, model: str, drafters: str, ks: str, prompts: int, tokens: int, via: bool, what: str) -> Stage:
        return Stage(
            name,
            (
                "bench",
                "--model",
                model,
                "--drafters",
                drafters,
                "--fixed-k",
                ks,
                "--prompts",
                str(prompts),
                "--max-new-tokens",
                str(tokens),
                *(("--via", "serve") if via else ()),
                *_E2E,
                "--out",
                str(out / name),
            ),
            what,
        )

    return [
        e2e("moon-a", MOONLIGHT, "none,ngram,eagle3,model", "1,2,4", 4, 64, True, "Moonlight, n-gram / EAGLE-3 / LM"),
        e2e("moon-b", MOONLIGHT, "none,dflash,mtp", "1,2,4", 4, 64, True, "Moonlight, DFlash / MTP"),
        e2e("k26", K26, "none,ngram,eagle3,model,dflash,mtp", "1,2,4", 2, 48, False, "K2.6 width, in process"),
        e2e("k26-serve-a", K26, "none,ngram,eagle3", "1,2", 2, 32, True, "K2.6 width through serve, n-gram / EAGLE-3"),
        e2e("k26-serve-b", K26, "none,model", "1,2", 2, 32, True, "K2.6 width through serve, LM"),
        Stage(
            "census",
            (
                "bench",
                "step",
                "--census",
                "--model",
                f"{MOONLIGHT},demo@kimi-k2.6:12",
                "--k",
                "0,3",
                "--steps",
                "10",
                "--out",
                str(out / "census"),
            ),
            "kernel census",
        ),
        Stage(
            "k26-shard",
            (
                "bench",
                "step",
                "--model",
                "demo@kimi-k2.6:6,demo@kimi-k2.6:12",
                "--shard",
                "0/4",
                "--contexts",
                "10240",
                "--max-k",
                "8",
                "--reps",
                "10",
                "--eager-reps",
                "0",
                "--out",
                str(out / "k26-shard"),
            ),
            "one rank's K2.6 shard",
        ),
        Stage(
            "k26-projection",
            (
                "bench",
                "project",
                "--step",
                str(out / "k26-shard" / "summary.json"),
                "--acceptance",
                str(out / "k26" / "summary.json"),
                "--context",
                "10240",
                "--out",
                str(out / "k26-projection"),
            ),
            "K2.6 on 4 GPUs, projected",
        ),
    ]


def _load(out: Path, name: str) -> dict | None:
    path = out / name / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _label(method: str) -> str:
    """eagle3/fixed/k2 -> 'EAGLE-3 k=2'."""
    names = {"ngram": "n-gram", "eagle3": "EAGLE-3", "model": "draft LM", "dflash": "DFlash", "mtp": "MTP"}
    parts = method.split("/")
    k = next((p[1:] for p in parts if p.startswith("k") and p[1:].isdigit()), None)
    return names.get(parts[0], parts[0]) + (f" k={k}" if k else "")


def _row(runs: Sequence[Mapping]) -> dict:
    """One target's cells from its e2e runs (each with its own target-only, which each ratio is against)."""
    base, best, served, adaptive, same = [], None, None, {}, []
    for run in runs:
        methods = run["methods"]
        t0 = methods["target-only"]["tokens_per_s"]
        base.append(t0)
        by_drafter: dict[str, list[tuple[float, str]]] = {}
        for name, m in methods.items():
            if m.get("kind") != "specserve" or m.get("via", "process") != "process":
                continue
            same.append(m.get("matches_target_only", 1.0))
            if m["drafter"] == "none":
                continue
            if m["speculation"] == "fixed":
                by_drafter.setdefault(m["drafter"], []).append((m["tokens_per_s"], name))
                if best is None or m["tokens_per_s"] / t0 > best[0]:
                    best = (m["tokens_per_s"] / t0, name)
        for name, m in methods.items():
            if m.get("kind") == "specserve" and m["speculation"] == "adaptive" and m.get("via", "process") == "process":
                fixed = max(by_drafter.get(m["drafter"], [(0.0, "")]))[0]
                if fixed:
                    adaptive[_label(m["drafter"])] = m["tokens_per_s"] / fixed
        for name, ways in (run.get("via") or {}).items():
            same.extend(w.get("matches_target_only", 1.0) for w in ways.values())
            shm = ways.get("serve-shm")
            if shm and "/fixed/" in name and (served is None or shm["tokens_per_s"] / t0 > served[0]):
                served = (shm["tokens_per_s"] / t0, name)
    return {
        "target_only": (min(base), max(base)) if base else None,
        "best": best,
        "served": served,
        "adaptive": adaptive,
        "same": min(same) if same else None,
    }


def _cells(target: str, row: dict) -> str:
    lo_hi = row["target_only"]
    t0 = (
        "-"
        if lo_hi is None
        else (f"{lo_hi[0]:.1f} tok/s" if abs(lo_hi[1] - lo_hi[0]) < 0.05 else f"{lo_hi[0]:.1f}-{lo_hi[1]:.1f} tok/s")
        + f" ({1e3 / lo_hi[1]:.2f} ms a step)"
    )
    best = "-" if row["best"] is None else f"{_label(row['best'][1])}: {row['best'][0]:.2f}x"
    served = "-" if row["served"] is None else f"{_label(row['served'][1])}: {row['served'][0]:.2f}x"
    adaptive = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(row["adaptive"].items())) or "-"
    same = "-" if row["same"] is None else f"{row['same']:.2f}"
    return f"| {target} | {t0} | {best} | {served} | {adaptive} | {same} |"


def headline_table(out: Path) -> str:
    """The headline table from the stages' summaries under ``out`` (a stage not run shows '-' or is left out)."""
    lines = [
        "| target | target-only | best fixed drafter, in process | through `serve`, shared memory | "
        "adaptive vs best fixed k | same output |",
        "|---|---:|---|---|---|---:|",
    ]
    moon = [s for s in (_load(out, "moon-a"), _load(out, "moon-b")) if s]
    k26 = [s for s in (_load(out, "k26"),) if s]
    k26_served = [s for s in (_load(out, "k26-serve-a"), _load(out, "k26-serve-b")) if s]
    if moon:
        lines.append(_cells(f"`{MOONLIGHT}`", _row(moon)))
    if k26 or k26_served:
        row = _row(k26) if k26 else _row(k26_served)
        if k26_served:
            served = _row(k26_served)
            row = {
                **row,
                "served": served["served"],
                "same": min(x for x in (row["same"], served["same"]) if x is not None),
            }
        lines.append(_cells(f"`{K26}`", row))
    proj = _load(out, "k26-projection")
    if proj and proj.get("projection_target_only_tokens_per_s"):
        t0 = proj["projection_target_only_tokens_per_s"]
        step = (proj.get("projection_step_ms_by_k") or {}).get("0", {}).get("step_ms")
        best = max(
            ((v["tokens_per_s"], k, v["k"]) for k, v in (proj.get("projection_best_k") or {}).items()), default=None
        )
        best_cell = "-" if best is None else f"{_label(best[1].split('/')[0])} k={best[2]}: {best[0]:.1f} tok/s"
        lines.append(
            f"| Kimi-K2.6 on 4 GPUs, **PROJECTION** from one rank's shard | "
            f"{'' if step is None else f'{step:.1f} ms a decode, '}{t0:.1f} tok/s | {best_cell} | - | - | - |"
        )
    census = _load(out, "census")
    if census:
        lines.append("")
        lines.append(
            "census (k = 0 / 3): "
            + "; ".join(
                f"{r['model']} k={r['k']}: {r['wall_ms']:.2f} ms ({r['wall_over_floor']:.1f}x its floor)"
                for r in census.get("rows", [])
            )
        )
    return "\n".join(lines)
