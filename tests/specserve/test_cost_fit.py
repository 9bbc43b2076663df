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


def test_draft_ahead_contention_is_its_own_term() -> None:
    """Steps that drafted ahead meanwhile cost a fixed extra; rows flagged ``ahead`` let the fit book it
    there instead of on tokens or experts (rows without the flag, from older runs, still load)."""
    rows = _rows(400, 0.001, seed=1)
    for i, r in enumerate(rows):
        r["ahead"] = i % 2 == 0
        r["verify_ms"] += 3.0 * r["ahead"]
    report = cost_model_error(rows)
    assert abs(report["coef_ms"]["ahead"] - 3.0) < 0.1
    assert report["median_rel_error"] < 0.01
    unflagged = cost_model_error([{k: v for k, v in r.items() if k != "ahead"} for r in rows])
    assert unflagged["coef_ms"]["ahead"] == 0.0 and unflagged["median_rel_error"] > 0.1
