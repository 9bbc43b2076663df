"""plots.phase_steps_figure: whole-number step ticks, and a legend that covers no panel."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from specserve.bench import plots  # noqa: E402


def _steps(method: str, n: int) -> list[dict]:
    return [{"method": method, "prompt": "p0", "step": i, "draft_ms": 0.5, "verify_ms": 1.0 + 0.1 * i,
             "overhead_ms": 0.2, "floor_ms": 0.4} for i in range(n)]


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
