"""The held-out error report of the verify cost model, on step rows shaped like steps.jsonl."""

import numpy as np

from specserve.bench.cost_fit import cost_model_error


def _rows(n: int, noise: float, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        drafted = int(rng.integers(0, 8))
        experts = 16 + 6 * drafted + int(rng.integers(0, 3))
        ms = (2.0 + 0.1 * (drafted + 1) + 0.01 * experts) * (1 + rng.normal(0, noise))
        rows.append({"drafted": drafted, "experts_touched": experts, "verify_ms": ms, "tree": False})
    return rows


def test_heldout_error_tracks_the_noise_of_the_steps() -> None:
    clean = cost_model_error(_rows(400, 0.001))
    noisy = cost_model_error(_rows(400, 0.2))
    assert clean["included"] and clean["heldout_steps"] == 120
    assert clean["median_rel_error"] < 0.005 < noisy["median_rel_error"]


def test_too_few_steps_is_reported_not_fitted() -> None:
    assert cost_model_error(_rows(5, 0.0)) == {"included": False, "reason": "only 5 steps"}
