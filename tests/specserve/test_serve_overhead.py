"""specserve/bench/serve_overhead.py: per-step orchestration overhead in one process, over shared memory and
gRPC only, in one run (real service processes, tiny checkpoint, CPU)."""

from __future__ import annotations

import json

import pytest
from shm_helpers import left_behind

from specserve.bench import serve_overhead
from specserve.cli.main import main
from specserve.runtime.shm_layout import SHM_DIR, leftover_names


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_serve_overhead_reports_each_via_with_the_model_time_taken_out(bench_target, tmp_path, capsys):
    before = set(leftover_names())
    rc = main(
        [
            "bench",
            "overhead",
            "--model",
            str(bench_target),
            "--drafters",
            "none,ngram",
            "--k",
            "2",
            "--requests",
            "1",
            "--max-new-tokens",
            "8",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["bench"] == "overhead" and result["config"]["k"] == 2
    assert set(result["methods"]) == {"target-only", "ngram/k2"}
    for method, vias in result["methods"].items():
        assert set(vias) == set(serve_overhead.VIAS)
        for via, s in vias.items():
            assert s["same_tokens"], (method, via)  # greedy: the same tokens every way
            assert s["steps"] >= 1 and s["engine_compute_us"]["median"] > 0  # the engine's time came back
            assert s["overhead_us"]["median"] < s["wall_us"]["median"]
            if via in serve_overhead.IN_PROCESS or (via in serve_overhead.TARGET_LOOP and method == "target-only"):
                assert s["transport_us"]["median"] == 0.0  # the target's loop: no hop to the target at all
            else:
                assert s["transport_us"]["median"] > 0.0  # the gateway's hops; the target loop's to the draft
        if method != "target-only":
            assert all(s["draft_compute_us"]["mean"] > 0 for s in vias.values())  # the proposer's time, every way
    svc = result["services"]
    measured = sum(result["methods"][m]["gateway-shm"]["steps"] for m in result["methods"])
    # the gateway's loop: its measured steps (and the warm-ups') went over shared memory; the target's loop: none did
    # (it calls its engine's host), and its proposals went over the draft's ring too
    assert svc["target"]["shm_steps"] > measured
    assert svc["target"]["steps"] > svc["target"]["shm_steps"] + sum(
        result["methods"][m]["serve-shm"]["steps"] for m in result["methods"]
    )
    assert svc["draft-ngram"]["shm_proposals"] > result["methods"]["ngram/k2"]["gateway-shm"]["steps"]
    assert "| target-only | serve-shm |" in capsys.readouterr().out
    assert left_behind(before) == set()  # other processes' names on a shared machine come and go


def test_serve_overhead_in_process_only_starts_no_service(bench_target, tmp_path):
    """--vias process,process-hops: the two in-process ways alone, compared as before, and no service process."""
    args = ["bench", "overhead", "--model", str(bench_target), "--drafters", "none,ngram", "--k", "2"]
    rc = main(
        [*args, "--vias", "process-hops,process", "--requests", "1", "--max-new-tokens", "8", "--rounds", "1"]
        + ["--out", str(tmp_path)]
    )
    assert rc == 0
    result = json.loads((tmp_path / "summary.json").read_text())
    assert "services" not in result
    for vias in result["methods"].values():
        assert list(vias) == ["process", "process-hops"]  # VIAS' order
        assert vias["process-hops"]["same_tokens"] and "overhead_vs_process_us" in vias["process-hops"]


def test_serve_overhead_refuses_bad_flags_in_one_line(capsys):
    assert main(["bench", "overhead", "--model", "synthetic:tiny-qwen3-moe:1", "--drafters", "ngram"]) == 2
    assert main(["bench", "overhead", "--model", "synthetic:tiny-qwen3-moe:1", "--drafters", "eagle9"]) == 2
    assert main(["bench", "overhead", "--model", "synthetic:tiny-qwen3-moe:1", "--vias", "serve-shm"]) == 2
    assert main(["bench", "overhead", "--model", "synthetic:tiny-qwen3-moe:1", "--vias", "process,smoke"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("specserve bench: error: --") for line in err), err
    assert all(
        "--vias: choose from process, process-hops, gateway-shm, serve-shm, serve-grpc, process among them" in e
        for e in err[2:]
    )
