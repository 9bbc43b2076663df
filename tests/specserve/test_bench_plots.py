"""plots.phase_steps_figure: whole-number step ticks, and a legend that covers no panel."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from specserve.bench import plots  # noqa: E402


def _steps(method: str, n: int) -> list[dict]:
    return [
        {
            "method": method,
            "prompt": "p0",
            "step": i,
            "draft_ms": 0.5,
            "verify_ms": 1.0 + 0.1 * i,
            "overhead_ms": 0.2,
            "floor_ms": 0.4,
        }
        for i in range(n)
    ]


def test_phase_steps_ticks_are_whole_steps_and_the_legend_is_over_no_panel(tmp_path):
    rows = _steps("target-only", 3) + _steps("ngram/fixed/k2", 4) + _steps("model/fixed/k2", 2)
    fig = plots.phase_steps_figure(rows, "per-step phases")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.axison]
    assert len(panels) == 3
    for ax in panels:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks  # 3 steps gave 0.5, 1.0, 1.5 ...
        assert ax.get_legend() is None
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in panels:
        assert not box.overlaps(ax.get_tightbbox(renderer)), "the legend covers a panel"
    assert {t.get_text() for t in legend.get_texts()} == {"draft", "verify", "overhead", "floor"}
    out = plots.plot_phase_steps(rows, tmp_path / "phase_steps.png", "per-step phases")
    assert out.stat().st_size > 0


def test_phase_steps_leave_no_blank_band_over_the_panels():
    """The title, then the legend's strip, then the panels: no more than a few tenths of an inch between the
    legend and the top panels (tight_layout used to make room for the title again: ~0.8 inch of nothing)."""
    rows = (
        _steps("target-only", 30)
        + _steps("ngram/fixed/k4", 20)
        + _steps("model/fixed/k4", 15)
        + _steps("eagle3/fixed/k4", 18)
    )
    fig = plots.phase_steps_figure(rows, "per-step phases")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    top = max(ax.get_tightbbox(renderer).y1 for ax in fig.axes if ax.axison)
    gap_inch = (legend.get_window_extent(renderer).y0 - top) / fig.dpi
    assert 0.0 <= gap_inch < 0.3, gap_inch
    title = fig._suptitle.get_window_extent(renderer)
    assert title.y0 >= legend.get_window_extent(renderer).y1 - 1  # the title over the legend, not on it


def test_plot_titles_name_only_the_speculation_modes_that_ran(tmp_path):
    from specserve.bench.bench import plot_tag
    from specserve.bench.config import BenchConfig

    def tag(cfg: BenchConfig, where: str) -> str:  # as the bench calls it
        return plot_tag(cfg.model, cfg.dtype, where, cfg.speculation, cfg.fixed_ks, cfg.max_k)

    fixed = BenchConfig(model=tmp_path, out=tmp_path, fixed_ks=(2, 4), speculation=("fixed",))
    assert tag(fixed, "AMD EPYC") == f"{tmp_path.name}, float32, AMD EPYC, fixed k=2,4"  # no 'adaptive cap'
    both = BenchConfig(model=tmp_path, out=tmp_path, num_speculative_tokens=4, speculation=("fixed", "adaptive"))
    assert tag(both, "H200").endswith("H200, fixed k=4, adaptive cap 4")
    adaptive = BenchConfig(model=tmp_path, out=tmp_path, num_speculative_tokens=6, speculation=("adaptive",))
    assert tag(adaptive, "H200").endswith("H200, adaptive cap 6")
