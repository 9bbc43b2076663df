"""`specserve bench step --census` on the GPU (skipped without CUDA): it profiles the engine as --invariant-steps
asks, and each row says which it ran (before, the census ignored the flag and always ran the engine's default)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("flag, padded", [("on", True), ("off", False)])
def test_census_runs_the_invariance_it_is_asked_for(flag: str, padded: bool, tmp_path) -> None:
    out = tmp_path / flag
    assert (
        main(
            [
                "bench",
                "step",
                "--census",
                "--model",
                "demo",
                "--k",
                "0,3",
                "--steps",
                "2",
                "--contexts",
                "64",
                "--invariant-steps",
                flag,
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads((out / "summary.json").read_text())["rows"]
    assert [r["k"] for r in rows] == [0, 3]
    assert all((r["invariant_rows"] > 0) == padded for r in rows)
