"""`specserve bench headline` (bench/headline.py, cli/bench_headline.py): each stage's command is one the CLI takes,
and the table is read back from real H200 summaries committed under benchmarks/results/ (the runs the headline's
rows came from), its cells equal to BENCHMARKS.md's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specserve.bench.headline import headline_table, stages
from specserve.cli.main import build_parser, main

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUNS = {  # stage -> a committed summary of the same command (BENCHMARKS.md's passes)
    "moon-a": "h200-real-size-4/via-serve-a/summary.json",
    "moon-b": "h200-real-size-4/via-serve-b/summary.json",
    "k26": "h200-real-size-5/k26-drafters/summary.json",
    "k26-serve-a": "h200-real-size-8/k26-serve-eagle3/summary.json",
    "census": "h200-real-size-9/census-k26/summary.json",
    "k26-projection": "h200-real-size-7/k26-projection/summary-eagle3-dflash-mtp.json",
}


def test_every_stage_is_a_command_the_cli_takes(tmp_path):
    plan = stages(tmp_path)
    assert [s.name for s in plan] == [
        "moon-a",
        "moon-b",
        "k26",
        "k26-serve-a",
        "k26-serve-b",
        "census",
        "k26-shard",
        "k26-projection",
    ]
    for s in plan:
        parser, _ = build_parser(list(s.argv))
        args = parser.parse_args(list(s.argv))  # a wrong flag exits here
        assert Path(args.out) == tmp_path / s.name
        if s.name != "k26-projection":
            assert args.device == "cuda" and args.dtype == "bfloat16", s.name


def test_the_table_from_the_h200_runs(tmp_path):
    for stage, rel in RUNS.items():
        (tmp_path / stage).mkdir()
        shutil.copy(RESULTS / rel, tmp_path / stage / "summary.json")
    lines = headline_table(tmp_path).splitlines()
    moon, k26, proj = (
        next(line for line in lines if line.startswith(f"| {t}"))
        for t in ("`demo@moonlight-16b-a3b`", "`demo@kimi-k2.6:6`", "Kimi-K2.6 on 4 GPUs")
    )
    # BENCHMARKS.md, the fourth pass: target-only 211.5 / 209.4 tok/s, EAGLE-3 k=2 through serve 1.16x
    assert "| 209.4-211.5 tok/s (4.73 ms a step) |" in moon and "| EAGLE-3 k=2: 1.16x |" in moon
    assert moon.endswith("| 1.00 |")
    # the eighth pass: EAGLE-3 k=2 over shared memory 231.3 against 260.5 in process
    assert "| EAGLE-3 k=2: 0.89x |" in k26
    # the seventh pass's projection: 17.1 ms a decode, 58.5 tok/s, DFlash k=4 86.6
    assert "| 17.1 ms a decode, 58.5 tok/s | DFlash k=4: 86.6 tok/s |" in proj
    assert any(line.startswith("census (k = 0 / 3): demo@kimi-k2.6:12 k=0: 4.57 ms") for line in lines)


def test_headline_table_only_prints_and_writes_it(tmp_path, capsys):
    (tmp_path / "moon-a").mkdir()
    shutil.copy(RESULTS / RUNS["moon-a"], tmp_path / "moon-a" / "summary.json")
    assert main(["bench", "headline", "--table-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "`demo@moonlight-16b-a3b`" in out and (tmp_path / "headline.md").read_text().strip() == out.strip()
    assert main(["bench", "headline", "--only", "nope", "--dry-run", "--out", str(tmp_path)]) == 2
    assert "--only: unknown stage(s) ['nope']" in capsys.readouterr().err


def test_a_stage_runs_in_its_own_process_and_its_row_is_printed(tmp_path, capsys):
    """The projection stage (no device) on the committed shard and K2.6 runs: the runner's path end to end."""
    for stage, rel in (("k26-shard", "h200-real-size-7/k26-shard/summary.json"), ("k26", RUNS["k26"])):
        (tmp_path / stage).mkdir()
        shutil.copy(RESULTS / rel, tmp_path / stage / "summary.json")
    assert main(["bench", "headline", "--only", "k26-projection", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "headline: [1/1] k26-projection" in err and "headline: k26-projection done in " in err
    assert "Kimi-K2.6 on 4 GPUs, **PROJECTION**" in out and "tok/s" in out
    record = json.loads((tmp_path / "headline.json").read_text())
    assert record["k26-projection"]["rc"] == 0 and (tmp_path / "logs" / "k26-projection.log").stat().st_size > 0


def test_a_run_of_some_stages_adds_to_the_record_of_the_others(tmp_path):
    """The headline split over two runs into one folder (`--only` each half: one device call is 10 minutes): the
    second run's headline.json keeps the first's stages, and the total is every stage's time."""
    for stage, rel in (("k26-shard", "h200-real-size-7/k26-shard/summary.json"), ("k26", RUNS["k26"])):
        (tmp_path / stage).mkdir()
        shutil.copy(RESULTS / rel, tmp_path / stage / "summary.json")
    first = {"moon-a": {"argv": ["bench"], "rc": 0, "wall_s": 85.0}, "total_wall_s": 85.0}
    (tmp_path / "headline.json").write_text(json.dumps(first))
    assert main(["bench", "headline", "--only", "k26-projection", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "headline.json").read_text())
    assert record["moon-a"] == first["moon-a"] and record["k26-projection"]["rc"] == 0
    assert record["total_wall_s"] == round(85.0 + record["k26-projection"]["wall_s"], 1)
