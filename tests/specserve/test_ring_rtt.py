"""specserve/bench/ring_rtt.py runs: every transport echoes through a real peer process."""

from __future__ import annotations

import json

import pytest

from specserve.bench import ring_rtt
from specserve.runtime.shm_ring import SHM_DIR, leftover_names


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")
def test_ring_rtt_measures_every_transport(tmp_path):
    before = set(leftover_names())
    out = tmp_path / "rtt.json"
    assert ring_rtt.main(["--n", "40", "--warmup", "5", "--spin-us", "5", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"shm-async", "shm-async-spin5", "shm-blocking", "shm-blocking-spin5", "grpc-uds"}
    for r in results.values():
        assert r["n"] == 40 and 0 < r["median_us"] <= r["p90_us"] <= r["p99_us"]
    assert set(leftover_names()) == before
