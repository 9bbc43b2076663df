"""Offline replay of chain-length policies on synthetic steps.jsonl rows."""

import numpy as np
import pytest

from specserve.bench.adaptive_replay import draft_table, drafters, replay, step_model
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


def test_draft_table_reads_the_drafters_fixed_rows() -> None:
    rows = [dict(_row("x", k, 0, 10.0, draft_ms=ms), k=k) for k, ms in ((1, 1.0), (1, 3.0), (1, 2.0), (4, 5.0))]
    rows += [dict(_row("x", 0, 0, 10.0, draft_ms=0.0), k=4)]  # a step that drafted nothing and took no time
    assert draft_table(rows, "x") == {1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}  # medians, linear between the k's run
    assert drafters(rows + [dict(_row("none", 0, 0, 9.0), k=0)]) == ["x"]
    with pytest.raises(ValueError, match="no fixed"):
        draft_table(rows, "y")


def test_step_model_keeps_the_largest_fixed_k_and_the_prompts_asked() -> None:
    """A file with several fixed k's: the blocks are the largest k's (a k = 1 step is no block of 1 asked for 4),
    in their recorded order; ``prompts`` keeps the prompts whose name starts with it, target-only's too."""
    rows = [dict(_row("none", 0, 0, 10.0 if i % 2 else 20.0), k=0, prompt=f"p{i % 2}") for i in range(8)]
    rows += [dict(_row("x", 1, 1, 11.0, draft_ms=1.0), k=1, prompt="p0") for _ in range(5)]
    rows += [dict(_row("x", 4, a, 12.0, draft_ms=2.0), k=4, prompt=f"p{a % 2}") for a in (0, 1, 2, 3, 4)]
    model = step_model(rows, "x", {k: 1.0 for k in range(1, 5)})
    assert model.max_k == 4 and model.blocks == ((4, 0), (4, 1), (4, 2), (4, 3), (4, 4))
    only = step_model(rows, "x", {k: 1.0 for k in range(1, 5)}, prompts="p1")
    assert only.blocks == ((4, 1), (4, 3)) and set(only.verify_ms[1]) == {10.0}


def test_recorded_order_replays_the_blocks_in_a_row() -> None:
    model = step_model(_rows([4, 4, 0, 0] * 10), "x", {k: 1.0 for k in range(1, 5)})
    drawn, recorded = replay(model, 4, steps=40, seed=1), replay(model, 4, steps=40, seed=1, order="recorded")
    assert recorded.chosen_k == {4: 40} and recorded.mean_accepted_length == pytest.approx(3.0)  # each block once
    assert drawn.mean_accepted_length != recorded.mean_accepted_length
    with pytest.raises(ValueError, match="order"):
        replay(model, 4, steps=4, order="sorted")


def test_the_replayed_chooser_may_cut_a_block_to_nothing() -> None:
    """The step loop verifies none of a drafted block when that pays (a probe keeps one); the replay forced one
    token into every drafted step's verify, charging a chooser a verify it would not have made."""

    class Cuts(AdaptiveSpeculation):
        def plan(self, limit, ahead=False):
            return 4, False

        def choose_k(self, limit, confidence=None, sunk_ms=None, ahead=False, least=0):
            return least

    model = step_model(_rows([0] * 30), "x", {k: 1.0 for k in range(1, 5)})
    assert replay(model, Cuts(AdaptiveConfig(max_k=4)), steps=50).chosen_k == {0: 50}


def test_command_line_replays_every_drafter_by_its_own_rows(tmp_path, capsys) -> None:
    import json

    rows = [dict(r, k=4, prompt="code-a") for r in _rows([4, 0, 2, 1] * 10)]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [str(path), "--drafter", "all", "--draft-ms", "auto", "--steps", "50", "--seeds", "2", "--order", "recorded"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"x"} and set(out["x"]) == {"k=1", "k=2", "k=3", "k=4", "adaptive"}
    with pytest.raises(SystemExit):
        main([str(path), "--drafter", "all", "--draft-ms", "1=1"])
