"""PNG plots of a bench run (matplotlib, Agg backend; nothing is shown on screen)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

PHASES = (("draft", "draft_ms", "#4c72b0"), ("verify", "verify_ms", "#dd8452"), ("overhead", "overhead_ms", "#8c8c8c"))


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(methods: dict, path: Path, title: str) -> Path:
    plt = _plt()
    names = [m for m, s in methods.items() if s.get("tokens_per_s")]
    values = [methods[m]["tokens_per_s"] for m in names]
    colors = ["#9a9a9a" if m.startswith("hf/") else "#4c72b0" for m in names]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
    ax.barh(names, values, color=colors)
    base = methods.get("target-only", {}).get("tokens_per_s")
    for i, v in enumerate(values):
        label = f"{v:.1f}" + (f"  ({v / base:.2f}x)" if base else "")
        ax.text(v, i, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s (single stream; grey: Hugging Face transformers)")
    ax.set_xlim(0, max(values, default=1) * 1.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_verify_tax(
    points: Sequence[dict], max_experts: int, path: Path, title: str, step_rows: Sequence[dict] = ()
) -> Path:
    plt = _plt()
    ks = [p["k"] for p in points]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if step_rows:  # verify steps seen during generation (context varies), for reference
        ax.scatter(
            [s["drafted"] for s in step_rows],
            [s["verify_ms"] for s in step_rows],
            s=4,
            alpha=0.15,
            color="#999999",
            label="generation steps (any context)",
        )
    ax.fill_between(
        ks,
        [p["verify_ms_p25"] for p in points],
        [p["verify_ms_p75"] for p in points],
        color="#dd8452",
        alpha=0.25,
        linewidth=0,
    )
    ax.plot(ks, [p["verify_ms_median"] for p in points], "o-", color="#dd8452", label="verify ms (median, IQR)")
    ax.plot(ks, [p["floor_ms"] for p in points], "s--", color="#2f7d32", label="bytes floor (dense + experts + KV)")
    ax.set_xlabel("drafted tokens k (forward feeds k + 1)")
    lows = [p["floor_ms"] for p in points if p["floor_ms"] > 0]
    highs = [p["verify_ms_p75"] for p in points]
    if lows and max(highs) / min(lows) > 20:  # floor far below the measurement: show both on a log axis
        ax.set_yscale("log")
        ax.set_ylabel("ms (log scale)")
    else:
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    ax2.plot(ks, [p["experts_touched_median"] for p in points], "o-", color="#4c72b0")
    if max_experts:
        ax2.axhline(max_experts, color="#999999", linestyle=":", label=f"all experts ({max_experts})")
        ax2.legend(fontsize=8)
    ax2.set_xlabel("drafted tokens k")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_ylabel("distinct (layer, expert) pairs read")
    ax2.set_ylim(bottom=0)
    ax2.set_title("union of routed experts per verify step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_phase_breakdown(methods: dict, path: Path, title: str) -> Path:
    """Mean per-step draft / verify / overhead per method, with the mean step floor marked."""
    plt = _plt()
    names = [m for m, s in methods.items() if "per_step_ms" in s]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4.5))
    bottom = [0.0] * len(names)
    for label, _, color in PHASES:
        vals = [max(methods[m]["per_step_ms"][label], 0.0) for m in names]
        ax.bar(names, vals, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(
        names,
        [methods[m]["per_step_ms"]["floor"] for m in names],
        marker="_",
        s=600,
        color="#2f7d32",
        label="bytes floor",
        zorder=3,
    )
    for i, m in enumerate(names):
        frac = methods[m].get("floor_fraction_of_step")
        if frac is not None:
            ax.text(i, bottom[i], f"floor {frac:.1%}", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per step (mean)")
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_phase_steps(step_rows: Sequence[dict], path: Path, title: str, max_panels: int = 20) -> Path:
    """Per-step stacked draft / verify / overhead, first prompt of each method (small multiples)."""
    plt = _plt()
    fig = phase_steps_figure(step_rows, title, max_panels)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def phase_steps_figure(step_rows: Sequence[dict], title: str, max_panels: int = 20):
    """The figure of plot_phase_steps: whole-number step ticks, and one legend for all panels in a strip of its own
    under the title (over no panel's bars)."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    by_method: dict[str, list[dict]] = {}
    for s in step_rows:
        first = by_method.setdefault(s["method"], [])
        if not first or first[0]["prompt"] == s["prompt"]:
            first.append(s)
    names = list(by_method)[:max_panels]
    cols = min(3 if len(names) <= 9 else 4, max(1, len(names)))
    rows = max(1, math.ceil(len(names) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 2.8 * rows + 0.8), squeeze=False)
    for ax, name in zip(axes.flat, names):
        steps = by_method[name]
        x = [s["step"] for s in steps]
        bottom = [0.0] * len(steps)
        for label, key, color in PHASES:
            vals = [max(s[key], 0.0) for s in steps]
            ax.bar(x, vals, bottom=bottom, color=color, width=1.0, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(x, [s["floor_ms"] for s in steps], color="#2f7d32", linewidth=1, label="floor")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_title(f"{name} ({steps[0]['prompt']})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("ms", fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    legend_h = 0.3 / fig.get_figheight()  # a strip of 0.3 inch under the title holds the legend
    title_h = 0.35 / fig.get_figheight()
    # the panels laid out first, into what the title and legend strips leave: tight_layout also makes room for a
    # suptitle it sees, which reserved the strips twice (a blank band over the panels)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - title_h - legend_h))
    fig.suptitle(title, fontsize=10, y=1.0 - 0.08 / fig.get_figheight(), va="top")
    if names:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(
            handles,
            labels,
            loc="upper center",
            ncol=len(labels),
            fontsize=7,
            frameon=False,
            bbox_to_anchor=(0.5, 1.0 - title_h),
        )
    return fig


def plot_projection(projection: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, points in projection["methods"].items():
        if points:
            ax.plot(
                [p["k"] for p in points], [p["tokens_per_s"] for p in points], "o--", label=f"{method} (projection)"
            )
    for method, m in (projection.get("per_method") or {}).items():
        hist = m.get("chosen_k") or {}
        if m.get("speculation") == "adaptive" and m.get("tokens_per_s") and hist:
            mean_k = sum(int(k) * n for k, n in hist.items()) / sum(hist.values())
            ax.plot([mean_k], [m["tokens_per_s"]], "*", markersize=11, label=f"{method} at its mean k (projection)")
    ax.axhline(projection["baseline_tokens_per_s"], color="#999999", linestyle=":", label="target-only (measured step)")
    ax.set_xlabel("drafted tokens k")
    ax.set_ylabel("tokens/s (PROJECTION)")
    ax.set_title(
        f"PROJECTION for {projection['shape']}: its measured step times x the demo model's acceptance", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
