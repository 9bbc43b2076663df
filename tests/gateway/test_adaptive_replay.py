"""Offline replay of chain-length policies on synthetic steps.jsonl rows."""

import numpy as np
import pytest

from specserve.bench.adaptive_replay import replay, step_model
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.tools.adaptive_replay import main


def _row(drafter, drafted, accepted, verify_ms, draft_ms=0.0, speculation="fixed", ahead=False):
    return {
        "drafter": drafter,
        "speculation": speculation,
        "draft_ahead": ahead,
        "drafted": drafted,
        "accepted": accepted,
        "verify_ms": verify_ms,
        "draft_ms": draft_ms,
        "experts_touched": 8 + 4 * drafted,
        "tree": False,
    }


def _rows(accepted_of_4, verify_ms=10.0):
    rows = [_row("none", 0, 0, verify_ms) for _ in range(20)]
    rows += [_row("x", 4, a, verify_ms, draft_ms=5.0) for a in accepted_of_4]
    rows += [_row("x", 4, 0, 99.0, draft_ms=5.0, ahead=True)]  # draft-ahead rows are left out
    return rows


def test_fixed_k_replay_is_exact_when_every_token_is_accepted() -> None:
    model = step_model(_rows([4] * 30), "x", {k: 2.0 + k for k in range(1, 5)})
    assert set(model.verify_ms) == {1, 5} and max(model.verify_ms[5]) == 10.0
    for k in (0, 1, 2, 4):
        r = replay(model, k, steps=200)
        draft = 2.0 + k if k else 0.0
        assert r.tokens_per_s == pytest.approx((k + 1) / (draft + 10.0) * 1e3)
        assert r.mean_accepted_length == k + 1 and r.chosen_k == {k: 200}


def test_adaptive_replay_is_close_to_the_best_fixed_k() -> None:
    rng = np.random.default_rng(0)
    # position i accepted with 0.7 given the ones before: the best fixed k is in the middle
    accepted = [int(np.argmin(np.append(rng.random(4) < 0.7, False))) for _ in range(400)]
    model = step_model(_rows(accepted), "x", {k: 1.0 + 3.0 * k for k in range(1, 5)})
    fixed = {k: replay(model, k, steps=2000).tokens_per_s for k in range(5)}
    best = max(fixed.values())
    assert max(fixed, key=fixed.get) in (1, 2, 3)
    adaptive = replay(model, AdaptiveSpeculation(AdaptiveConfig(max_k=4)), steps=2000)
    assert adaptive.tokens_per_s >= 0.95 * best


def test_step_model_refuses_missing_inputs() -> None:
    with pytest.raises(ValueError, match="no fixed"):
        step_model(_rows([1, 2]), "y", {k: 1.0 for k in range(1, 5)})
    with pytest.raises(ValueError, match="draft_ms lacks"):
        step_model(_rows([1, 2]), "x", {1: 1.0})


def test_command_line_compares_fixed_k_and_adaptive(tmp_path, capsys) -> None:
    import gzip
    import json

    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows([4, 0, 2, 1] * 10)))
    assert main([str(path), "--drafter", "x", "--draft-ms", "1=1,2=2,3=3,4=4", "--steps", "100", "--seeds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"k=1", "k=2", "k=3", "k=4", "adaptive"} and all(v > 0 for v in out.values())
    assert main([str(path), "--drafter", "nope", "--draft-ms", "1=1,2=2,3=3,4=4"]) == 2
    assert "no fixed" in capsys.readouterr().err
    gz = tmp_path / "steps.jsonl.gz"  # the committed artifacts' form: the same rows, the same comparison
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert main([str(gz), "--drafter", "x", "--draft-ms", "1=1,2=2,3=3,4=4", "--steps", "100", "--seeds", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == out
