"""bench/result.read_jsonl: a bench's .jsonl artifact read plain or from its committed gzipped copy, and the
committed runs' projection input (benchmarks/results/, steps.jsonl.gz) read through it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from specserve.bench.projection import load_run
from specserve.bench.result import jsonl_exists, read_jsonl

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
ROWS = [{"step": 1, "k": 2}, {"step": 2, "k": 0}]


def test_a_jsonl_reads_the_same_plain_or_gzipped(tmp_path):
    plain = tmp_path / "steps.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    assert read_jsonl(plain) == ROWS
    with gzip.open(tmp_path / "z.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    assert read_jsonl(tmp_path / "z.jsonl") == ROWS == read_jsonl(tmp_path / "z.jsonl.gz")
    assert jsonl_exists(tmp_path / "z.jsonl") and not jsonl_exists(tmp_path / "none.jsonl")
    with pytest.raises(FileNotFoundError, match="none.jsonl: no such file"):
        read_jsonl(tmp_path / "none.jsonl")


def test_the_committed_headline_run_projects_with_its_gzipped_steps():
    """The projection replays a run's steps when they are beside its summary: the committed ones are gzipped."""
    summary = RESULTS / "h200-headline-1" / "k26" / "summary.json"
    assert not (summary.parent / "steps.jsonl").exists() and (summary.parent / "steps.jsonl.gz").exists()
    methods, steps = load_run(summary)
    assert "target-only" in methods and len(steps) > 1000
