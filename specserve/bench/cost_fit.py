"""How well the adaptive chooser's verify cost model predicts steps it did not see.

The model (specserve/loop/adaptive.py, VerifyCostModel) is fitted on the first part of a run's verify steps
(in the order they ran) and scored on the rest: median relative error |predicted - measured| /
measured, overall and by the number of tokens in the verify forward. Run it on a bench's artifacts:

    python -m specserve.tools.cost_fit OUT/steps.jsonl [--train-fraction 0.7]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specserve.loop.cost_models import VerifyCostModel


def cost_model_error(steps: Sequence[dict], train_fraction: float = 0.7) -> dict:
    """Fit on the first train_fraction of chain steps, report the held-out prediction error.

    Each step row needs drafted, experts_touched and verify_ms (the schema of steps.jsonl); ``ahead``
    (the drafter drafted the next block during this verify; absent in older runs) is the model's
    contention term.
    """
    rows = [
        (int(s["drafted"]) + 1, int(s["experts_touched"]), float(s["verify_ms"]), bool(s.get("ahead", False)))
        for s in steps
        if not s.get("tree") and s.get("verify_ms", 0) > 0
    ]
    if len(rows) < 10:
        return {"included": False, "reason": f"only {len(rows)} steps"}
    cut = int(len(rows) * train_fraction)
    model = VerifyCostModel(window=cut, refit_every=cut)
    for n, e, ms, ahead in rows[:cut]:
        model.observe(n, e, ms, ahead)
    model.fit()
    held = rows[cut:]
    by_tokens = {}
    for n in sorted({r[0] for r in held}):
        part = [r for r in held if r[0] == n]
        by_tokens[str(n)] = {"steps": len(part), "median_rel_error": round(model.heldout_error(part), 4)}
    return {
        "included": True,
        "train_steps": cut,
        "heldout_steps": len(held),
        "coef_ms": {
            "a": round(float(model.coef[0]), 4),
            "per_token": round(float(model.coef[1]), 5),
            "per_expert": round(float(model.coef[2]), 6),
            "ahead": round(float(model.coef[3]), 4),
        },
        "median_rel_error": round(model.heldout_error(held), 4),
        "p90_rel_error": round(
            float(np.percentile([abs(model.predict(n, e, ahead) - ms) / ms for n, e, ms, ahead in held], 90)), 4
        ),
        "by_tokens": by_tokens,
    }
