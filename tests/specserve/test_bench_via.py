"""`specserve bench --via serve`: every method in one process and through service processes (shared
memory, gRPC only), in the same run, with the per-step overhead of each (tiny checkpoints, CPU)."""

from __future__ import annotations

import json

from specserve.cli.main import main


def test_bench_via_serve_measures_each_method_three_ways(bench_target, bench_draft_lm, tmp_path, capsys):
    out = tmp_path / "via"
    rc = main(
        [
            "bench",
            "--via",
            "serve",
            "--model",
            str(bench_target),
            "--draft-models",
            f"model={bench_draft_lm}",
            "--drafters",
            "none,model",
            "--max-new-tokens",
            "8",
            "--num-speculative-tokens",
            "2",
            "--prompts",
            "1",
            "--speculation",
            "fixed",
            "--draft-ahead",
            "off",
            "--no-hf",
            "--k-sweep",
            "0,1",
            "--tax-context",
            "16",
            "--tax-repeats",
            "1",
            "--warmup",
            "0",
            "--bandwidth-mib",
            "1",
            "--num-kv-blocks",
            "64",
            "--kv-block-size",
            "8",
            "--no-plots",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    via = summary["via"]
    assert set(via) == {"target-only", "model/fixed/k2"}
    for name, row in via.items():
        assert set(row) == {"process", "serve-shm", "serve-grpc"}
        for where, r in row.items():
            assert r["matches_target_only"] == 1.0, where  # the same greedy tokens every way
            ph = r["per_step_ms"]
            assert abs(ph["wall"] - ph["draft"] - ph["verify"] - ph["overhead"]) < 1e-3
            if where == "process" or name == "target-only":  # served: the target runs the loop (no hop to it)
                assert ph["transport"] == 0.0
            else:  # the time outside the draft service: part of the overhead, never more
                assert 0.0 < ph["transport"] <= ph["overhead"] + 1e-3, where
        assert row["serve-shm"]["fraction_of_process"] > 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    by_via = {v: [s for s in steps if s["via"] == v] for v in ("process", "serve-shm", "serve-grpc")}
    assert all(by_via.values())
    served = summary["served_stats"]
    # the target ran every served step in its own loop (no step came over a channel); the shm rows' proposals went
    # over the draft's ring, the grpc rows' did not
    assert served["target"]["shm_steps"] == 0
    assert served["target"]["steps"] == len(by_via["serve-shm"]) + len(by_via["serve-grpc"])
    model_shm = [s for s in by_via["serve-shm"] if s["drafter"] == "model" and s["drafted"]]
    assert served["draft-model"]["shm_proposals"] == len(model_shm) > 0
    for s in model_shm:
        assert s["draft_ms"] <= s["draft_wall_ms"]  # the service's own draft time; the transport is overhead
    assert "In one process against the service processes" in printed
