"""Session fixtures for the bench tests: tiny random checkpoints (see bench_helpers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import DRAFT_LM, TARGET, save_checkpoint, save_eagle3


@pytest.fixture(scope="session")
def bench_target(tmp_path_factory) -> Path:
    return save_checkpoint("deepseek_v3", TARGET, tmp_path_factory.mktemp("bench") / "target")


@pytest.fixture(scope="session")
def bench_draft_lm(tmp_path_factory) -> Path:
    return save_checkpoint("llama", DRAFT_LM, tmp_path_factory.mktemp("bench") / "draft_lm")


@pytest.fixture(scope="session")
def bench_eagle3(tmp_path_factory) -> Path:
    return save_eagle3(tmp_path_factory.mktemp("bench") / "eagle3")


@pytest.fixture(scope="session")
def bench_run(bench_target, bench_draft_lm, bench_eagle3, tmp_path_factory):
    """The whole `specserve bench` command, through the CLI entry point, on tiny random checkpoints (CPU,
    seconds): two fixed k, adaptive, draft-ahead on and off, and a projection from hand-made timings."""
    from specserve.bench.projection import ShapeTimings, save_shape_timings
    from specserve.cli.main import main

    out = tmp_path_factory.mktemp("bench_out")
    timings = ShapeTimings(
        "test shape", "unit-test numbers, not a measurement", "none", {0: 10.0, 1: 11.0, 2: 12.0}, {}
    )
    save_shape_timings(timings, out / "shape_timings.json")
    rc = main(
        [
            "bench",
            "--projection-timings",
            str(out / "shape_timings.json"),
            "--model",
            str(bench_target),
            "--draft-models",
            f"model={bench_draft_lm},eagle3={bench_eagle3}",
            "--drafters",
            "none,ngram,model,eagle3,dflash,mtp",
            "--max-new-tokens",
            "6",
            "--num-speculative-tokens",
            "2",
            "--fixed-k",
            "2,1",
            "--prompts",
            "1",
            "--speculation",
            "both",
            "--draft-ahead",
            "both",
            "--k-sweep",
            "0,1,3",
            "--tax-context",
            "16",
            "--tax-repeats",
            "2",
            "--warmup",
            "0",
            "--bandwidth-mib",
            "1",
            "--num-kv-blocks",
            "64",
            "--kv-block-size",
            "8",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    return out, json.loads((out / "summary.json").read_text())
