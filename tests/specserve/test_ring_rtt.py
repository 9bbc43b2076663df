"""specserve/bench/ring_rtt.py (`specserve bench overhead --ring`) runs: every transport echoes through a real peer
process."""

from __future__ import annotations

import json

import pytest

from specserve.cli.main import main
from specserve.runtime.shm_layout import SHM_DIR, leftover_names


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_ring_rtt_measures_every_transport(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_GIT_COMMIT", "1fc4c0f-dirty")  # the commit the summary names, not .git's
    before = set(leftover_names())
    assert (
        main(["bench", "overhead", "--ring", "--n", "40", "--warmup", "5", "--spin-us", "5", "--out", str(tmp_path)])
        == 0
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench"] == "overhead-ring"
    assert summary["environment"]["git"] == {"commit": "1fc4c0f", "dirty": True, "source": "SPECSERVE_GIT_COMMIT"}
    results = summary["results"]
    assert set(results) == {"shm-async", "shm-async-spin5", "shm-blocking", "shm-blocking-spin5", "grpc-uds"}
    for r in results.values():
        assert r["n"] == 40 and 0 < r["median_us"] <= r["p90_us"] <= r["p99_us"]
    assert set(leftover_names()) == before
