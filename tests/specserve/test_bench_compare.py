"""`specserve bench --fixed-k`: one fixed method per k, adaptive capped at the largest k, and the
per-drafter comparison (adaptive against the best fixed k, draft-ahead on against off), measured and
projected."""

from __future__ import annotations

import pytest
from bench_helpers import read_jsonl

from specserve.bench.compare import compare_methods, format_comparison
from specserve.bench.config import (
    BenchConfig,
    BenchConfigError,
    MethodSpec,
    plan_methods,
)
from specserve.bench.projection import ShapeTimings, project_steps, step_ms_at


# ---------------------------------------------------------------- config and plan
def test_fixed_ks_are_validated(tmp_path):
    cfg = BenchConfig(model=tmp_path, out=tmp_path, num_speculative_tokens=3)
    assert cfg.fixed_ks == (3,) and cfg.max_k == 3 and cfg.drafter_block_size == 4  # the old behaviour
    cfg = BenchConfig(model=tmp_path, out=tmp_path, num_speculative_tokens=2, fixed_ks=(4, 1, 4))
    assert cfg.fixed_ks == (1, 4) and cfg.max_k == 4 and cfg.drafter_block_size == 5
    for bad in ((0,), (2, -1), (1.5,), (True,)):
        with pytest.raises(BenchConfigError, match="fixed_ks"):
            BenchConfig(model=tmp_path, out=tmp_path, fixed_ks=bad)
    with pytest.raises(BenchConfigError):
        MethodSpec("model", k=0)  # a drafter method drafts at least one token
    with pytest.raises(BenchConfigError):
        MethodSpec("none", k=2)


@pytest.mark.parametrize("value", ["0", "1,-2", "a,b", ",", "1.5"])
def test_bad_fixed_k_flag_is_one_line_not_a_traceback(value, capsys):
    from specserve.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--fixed-k", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--fixed-k: expected comma-separated positive integers (drafted tokens per step), got {value!r}" in err


def test_plan_runs_each_fixed_method_once_per_k(tmp_path):
    cfg = BenchConfig(
        model=tmp_path,
        out=tmp_path,
        drafters=("none", "ngram", "eagle3"),
        num_speculative_tokens=2,
        fixed_ks=(3, 1),
        speculation=("fixed", "adaptive"),
        draft_ahead=(False, True),
    )
    methods, skipped = plan_methods(cfg, {"ngram": True, "eagle3": True}, {"eagle3": True})
    assert [m.name for m in methods] == [
        "target-only",
        "ngram/fixed/k1",
        "ngram/fixed/k1/ahead",
        "ngram/fixed/k3",
        "ngram/fixed/k3/ahead",
        "ngram/adaptive",
        "ngram/adaptive/ahead",
        "eagle3/fixed/k1",
        "eagle3/fixed/k3",
        "eagle3/adaptive",
    ]
    assert {m.k for m in methods if m.adaptive} == {3}  # adaptive's cap: the largest k of the run
    assert [m.k for m in methods if m.drafter == "none"] == [0]
    assert {s.method for s in skipped} == {"eagle3/fixed/k1/ahead", "eagle3/fixed/k3/ahead", "eagle3/adaptive/ahead"}


# ---------------------------------------------------------------- comparison block (hand-made entries)
def _m(drafter, speculation, k, tps, ahead=False, **more):
    return {
        "kind": "specserve",
        "drafter": drafter,
        "speculation": speculation,
        "draft_ahead": ahead,
        "k": k,
        "tokens_per_s": tps,
        **more,
    }


def test_comparison_picks_the_best_fixed_k_hand_computed():
    methods = {
        "target-only": _m("none", "fixed", 0, 50.0),
        "model/fixed/k1": _m("model", "fixed", 1, 60.0, per_step_ms={"verify": 5.0}),
        "model/fixed/k1/ahead": _m(
            "model",
            "fixed",
            1,
            66.0,
            ahead=True,
            per_step_ms={"verify": 5.5},
            draft_ahead_stats={"hits": 3, "ahead_ms": 9.0, "hidden_ms": 7.5, "wait_ms": 1.5},
            steps=10,
        ),
        "model/fixed/k2": _m("model", "fixed", 2, 80.0),
        "model/adaptive": _m("model", "adaptive", 2, 70.0, chosen_k={"1": 4, "2": 6}),
        "hf/greedy": {"kind": "transformers", "drafter": "greedy", "tokens_per_s": 10.0},
    }
    c = compare_methods(methods)
    assert c["target_only_tokens_per_s"] == 50.0
    off, on = c["adaptive_vs_fixed"]
    assert (off["drafter"], off["draft_ahead"], on["draft_ahead"]) == ("model", False, True)
    assert off["fixed_tokens_per_s_by_k"] == {"1": 60.0, "2": 80.0}
    assert off["best_fixed"] == {"method": "model/fixed/k2", "k": 2, "tokens_per_s": 80.0, "vs_target_only": 1.6}
    assert off["adaptive"] == {
        "method": "model/adaptive",
        "max_k": 2,
        "tokens_per_s": 70.0,
        "vs_target_only": 1.4,
        "chosen_k": {"1": 4, "2": 6},
    }
    assert off["adaptive_over_best_fixed"] == 0.875
    assert on["best_fixed"]["k"] == 1 and on["adaptive"] is None and on["adaptive_over_best_fixed"] is None
    assert c["draft_ahead"] == [
        {
            "method": "model/fixed/k1",
            "off_tokens_per_s": 60.0,
            "on_tokens_per_s": 66.0,
            "on_over_off": 1.1,
            "ahead_hits": 3,
            "ahead_ms": 9.0,
            "hidden_ms": 7.5,
            "wait_ms": 1.5,
            "off_verify_ms": 5.0,
            "on_verify_ms": 5.5,
            "steps": 10,
        }
    ]
    md = format_comparison(c, "title")
    assert "| model | off | k1: 60.0 k2: 80.0 | 2 | 80.0 (1.60x) | 70.0 (1.40x) (cap 2) | 0.88x | 1:4 2:6 |" in md
    assert "| model/fixed/k1 | 60.0 | 66.0 | 1.10x | 3 / 10 | 9.0 | 7.5 | 1.5 | 5.00 -> 5.50 |" in md
    assert "draft_ahead" not in compare_methods(methods, draft_ahead=False)


# ---------------------------------------------------------------- projection of every method (hand-made rows)
def test_projection_prices_each_step_at_its_own_drafted_count():
    timings = ShapeTimings("X", "test", "gpu", {0: 10.0, 1: 11.0, 2: 12.0, 4: 16.0}, {})
    assert step_ms_at(timings, 3) == pytest.approx(14.0)  # between the measured k = 2 and k = 4
    assert step_ms_at(timings, 5) is None  # beyond the largest measured k
    methods = {
        "target-only": _m("none", "fixed", 0, 1.0),
        "ngram/adaptive": _m("ngram", "adaptive", 4, 1.0, chosen_k={"0": 1, "2": 1, "3": 1}),
        "ngram/fixed/k4": _m("ngram", "fixed", 4, 1.0),
        "hf/greedy": {"kind": "transformers", "tokens_per_s": 1.0},
    }
    steps = [
        {"method": "target-only", "drafted": 0, "accepted": 0},
        {"method": "target-only", "drafted": 0, "accepted": 0},
        {"method": "ngram/adaptive", "drafted": 0, "accepted": 0},
        {"method": "ngram/adaptive", "drafted": 2, "accepted": 2},
        {"method": "ngram/adaptive", "drafted": 3, "accepted": 1},
        {"method": "ngram/fixed/k4", "drafted": 5, "accepted": 0},
    ]
    out = project_steps(timings, methods, steps)
    assert set(out) == {"target-only", "ngram/adaptive", "ngram/fixed/k4"}
    assert out["target-only"]["tokens_per_s"] == 100.0 and out["target-only"]["vs_target_only"] == 1.0
    ada = out["ngram/adaptive"]  # 1 + 3 + 2 tokens in 10 + 12 + 14 ms
    assert (ada["emitted"], ada["projected_ms"], ada["steps"]) == (6, 36.0, 3)
    assert ada["tokens_per_s"] == pytest.approx(6e3 / 36.0, rel=1e-4)
    assert ada["chosen_k"] == {"0": 1, "2": 1, "3": 1} and ada["speculation"] == "adaptive"
    assert out["ngram/fixed/k4"]["tokens_per_s"] is None and "largest timed k" in out["ngram/fixed/k4"]["reason"]


# ---------------------------------------------------------------- a real run: --fixed-k 1,2 --speculation both
def test_run_compares_adaptive_with_every_fixed_k(bench_run):
    out, summary = bench_run
    methods = summary["methods"]
    assert summary["config"]["fixed_ks"] == [1, 2]
    for name, m in methods.items():
        if m["kind"] == "specserve":
            assert m["matches_target_only"] == 1.0, name  # greedy: every method emits the target-only output
    rows = {(r["drafter"], r["draft_ahead"]): r for r in summary["comparison"]["adaptive_vs_fixed"]}
    assert set(rows) == {("ngram", False), ("ngram", True), ("model", False), ("model", True), ("eagle3", False)}
    for (drafter, ahead), r in rows.items():
        suffix = "/ahead" if ahead else ""
        by_k = {k: methods[f"{drafter}/fixed/k{k}{suffix}"]["tokens_per_s"] for k in ("1", "2")}
        assert r["fixed_tokens_per_s_by_k"] == by_k
        best_k = max(by_k, key=by_k.get)
        assert r["best_fixed"]["method"] == f"{drafter}/fixed/k{best_k}{suffix}"
        ada = methods[f"{drafter}/adaptive{suffix}"]
        assert r["adaptive"]["max_k"] == 2 and r["adaptive"]["chosen_k"] == ada["chosen_k"]
        assert r["adaptive_over_best_fixed"] == pytest.approx(ada["tokens_per_s"] / by_k[best_k], abs=1e-4)
    ahead = {r["method"]: r for r in summary["comparison"]["draft_ahead"]}
    assert set(ahead) == {f"{d}/{s}" for d in ("ngram", "model") for s in ("fixed/k1", "fixed/k2", "adaptive")}
    for name, r in ahead.items():
        assert r["hidden_ms"] == methods[name + "/ahead"]["draft_ahead_stats"]["hidden_ms"] >= 0
    steps = read_jsonl(out / "steps.jsonl")
    assert all(s["drafted"] <= 1 for s in steps if s["method"].startswith("model/fixed/k1"))
    table = (out / "table.md").read_text()
    assert "### Adaptive against the best fixed k (measured)" in table and "| ngram/fixed/k1 |" in table
    assert "### PROJECTION (not measured) for test shape" in table


def test_run_projects_every_method(bench_run):
    _, summary = bench_run
    proj = summary["projection"]
    ours = {n for n, m in summary["methods"].items() if m["kind"] == "specserve"}
    assert proj["label"] == "projection" and set(proj["per_method"]) == ours
    assert proj["per_method"]["target-only"]["tokens_per_s"] == proj["baseline_tokens_per_s"] == 100.0
    for name, p in proj["per_method"].items():
        assert p["tokens_per_s"] > 0 and p["steps"] == summary["methods"][name]["steps"], name
    rows = proj["comparison"]["adaptive_vs_fixed"]
    assert [r["drafter"] for r in rows] == ["ngram", "model", "eagle3"] and "draft_ahead" not in proj["comparison"]
    for r in rows:  # no draft time in these timings: the draft-ahead twins are projected but not compared
        assert not r["draft_ahead"] and r["adaptive"]["max_k"] == 2
        assert r["adaptive"]["tokens_per_s"] == proj["per_method"][f"{r['drafter']}/adaptive"]["tokens_per_s"]
        by_k = {k: proj["per_method"][f"{r['drafter']}/fixed/k{k}"]["tokens_per_s"] for k in ("1", "2")}
        assert r["fixed_tokens_per_s_by_k"] == by_k and r["best_fixed"]["tokens_per_s"] == max(by_k.values())
