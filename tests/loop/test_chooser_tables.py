"""The chooser reads tables made when an estimate changes, not per step (issue #42): its cost tables survive steady
steps and alternating lengths, and its calibration and acceptance tables equal the formulas they replace."""

import json

import numpy as np
import pytest

from specserve.loop.adaptive import AcceptanceEstimator, AdaptiveConfig, AdaptiveSpeculation, ConfidenceCalibration
from specserve.loop.cost_models import DraftCostModel


def test_a_steady_draft_timing_leaves_the_draft_costs_as_they_were() -> None:
    """A timing that moves no k's least (nor settles a k) changes no cost: no refit, same version."""
    model = DraftCostModel(window=4)
    for ms in (2.5, 2.2, 2.1, 2.0):  # k = 3 settles at 2.0
        model.observe(3, ms)
    version, costs = model.version, model.costs(4)
    for ms in (2.3, 2.4, 2.6):  # the least of the last four stays 2.0
        model.observe(3, ms)
    assert model.version == version and model.costs(4) == costs
    model.observe(3, 2.7)  # 2.0 leaves the window: the least is now 2.3
    assert model.version > version and model.costs(4)[3] == pytest.approx(2.3)


def test_the_step_cost_tables_are_made_once_per_estimate() -> None:
    """Steady steps choosing alternately before drafting (k up to 4) and cutting a drafted block (k up to 2) read the
    same two tables: neither is rebuilt while no cost model changes."""
    spec = AdaptiveSpeculation(AdaptiveConfig(max_k=4, refit_every=10_000))
    for n in range(1, 6):
        spec.cost.observe(n, 10 * n, 3.0 + 0.1 * n)
    spec.cost.fit()
    for k in (1, 2, 3, 4):
        for _ in range(4):
            spec.observe_draft(k, 0.5 * k)
    four, two = spec.step_costs(4), spec.step_costs(2)
    for _ in range(20):
        k, _ = spec.plan(4)
        spec.observe_draft(2, 1.0)  # k = 2's least again: no cost changes
        cut = spec.choose_k(2, np.array([0.9, 0.2]), sunk_ms=1.0)
        spec.observe_verify(cut, min(cut, 1), 10 * (cut + 1), 3.0)  # fits never due (refit_every)
        assert spec.step_costs(4) is four and spec.step_costs(2) is two
    assert two.verify_ms == four.verify_ms[:3] and two.draft_ms == four.draft_ms[:3]


def test_the_calibration_table_is_the_per_bin_formula() -> None:
    rng = np.random.default_rng(3)
    cal = ConfidenceCalibration(bins=10, prior=4.0, window=32)
    for _ in range(300):
        q = rng.uniform(0, 1, 4)
        cal.observe(q, int(rng.integers(0, 5)))
    q = rng.uniform(-0.1, 1.1, 200)
    clipped = np.clip(q, 0.0, 1.0)
    b = np.clip((clipped * 10).astype(int), 0, 9)
    expected = (cal.hits[b] + 4.0 * clipped) / (cal.trials[b] + 4.0)
    assert cal.calibrated(q.tolist()) == pytest.approx(expected.tolist(), rel=1e-12)
    assert cal(q) == pytest.approx(expected, rel=1e-12)


def test_the_acceptance_table_follows_each_observation() -> None:
    est = AcceptanceEstimator(max_k=4, prior=0.6, memory=16.0)
    first = est.alpha
    first[0] = 99.0  # the caller's copy: the table is not changed through it
    assert est.alpha == pytest.approx([0.6] * 4)
    est.observe(4, 1)
    hits, trials, mean, expected = est.hits, est.trials, 0.6, []
    for i in range(4):
        mean = (hits[i] + 4.0 * mean) / (trials[i] + 4.0)
        expected.append(mean)
    assert est.alpha == pytest.approx(expected) and est.alpha[0] > 0.6 > est.alpha[1]


def test_bench_overhead_times_the_chooser_a_step(tmp_path, capsys) -> None:
    from specserve.cli.main import main

    assert main(["bench", "overhead", "--chooser", "--n", "300", "--out", str(tmp_path)]) == 0

    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert set(parts) == {"plan", "cut", "observe", "step"}
    assert all(0 < p["median"] <= p["p90"] for p in parts.values())
    assert parts["step"]["median"] >= parts["plan"]["median"]
    assert "| step |" in capsys.readouterr().out
