"""`specserve bench`, the one front door (cli/bench_cmd.py): its subcommands on the CPU at tiny sizes, each writing
summary.json in one schema (bench/result.py); bare `specserve bench` is e2e; every bench command the docs quote parses,
and none names a `python -m` module that went behind the front door."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from specserve.bench.result import ENVIRONMENT_KEYS, SCHEMA_VERSION, SUMMARY_KEYS
from specserve.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DOCS = (
    "README.md",
    "BENCHMARKS.md",
    "ARCHITECTURE.md",
    "Makefile",
    *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")),
)
# modules whose flags and output moved behind `specserve bench` (their `python -m` entry points are gone)
MOVED = (
    "step_bench",
    "step_profile",
    "kernel_bench",
    "quant_kernel_bench",
    "serve_overhead",
    "k2_projection",
    "draft_profile",
    "ring_rtt",
    "projection ",
    "allreduce_bench",
)


def assert_schema(summary: dict, bench: str) -> None:
    assert set(SUMMARY_KEYS) <= set(summary) and summary["schema_version"] == SCHEMA_VERSION
    assert summary["bench"] == bench and isinstance(summary["config"], dict)
    env = summary["environment"]
    assert set(ENVIRONMENT_KEYS) <= set(env)
    assert {"torch", "triton", "flashinfer-python", "transformers", "cuda"} <= set(env["versions"])
    assert env["versions"]["torch"] and len(env["specserve"]["source_sha256"]) == 64 and "commit" in env["git"]


def _read(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_step_then_project_from_its_summary_and_an_e2e_runs_acceptance(bench_run, tmp_path, capsys):
    step = tmp_path / "step"
    rc = main(
        [
            "bench",
            "step",
            "--model",
            "tiny-kimi-k2-int4:1,tiny-kimi-k2-int4:3",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-graphs",
            "--contexts",
            "8",
            "--max-k",
            "1",
            "--reps",
            "1",
            "--eager-reps",
            "0",
            "--shard",
            "0/4",
            "--out",
            str(step),
        ]
    )
    assert rc == 0
    summary = _read(step)
    assert_schema(summary, "step")
    assert summary["environment"]["bandwidth"]["bytes_per_s"] > 0 and summary["config"]["shard"] == [0, 4]
    assert [r["layers"] for r in summary["results"]] == [1, 3] and (step / "step_bench.md").is_file()
    # The CPU's step times are noise; what this checks is that project reads the step summary as written: its
    # graph_ms made a clean line in the layer count, everything else as measured.
    for res in summary["results"]:
        for row in res["rows"]:
            row["graph_ms"] = 1.0 + 0.5 * res["layers"] + 0.1 * row["k"]
    (step / "summary.json").write_text(json.dumps(summary))
    e2e_out, _ = bench_run
    proj = tmp_path / "proj"
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "project",
                "--step",
                str(step / "summary.json"),
                "--acceptance",
                str(e2e_out / "summary.json"),
                "--out",
                str(proj),
            ]
        )
        == 0
    )
    result = _read(proj)
    assert_schema(result, "project")
    assert result["projection_inputs"]["shard_model"] == "tiny-kimi-k2-int4"
    assert result["projection_fit"]["0"]["per_layer_ms"] == pytest.approx(0.5)
    assert set(result["projection_tokens_per_s_by_k"]) >= {"ngram/fixed/k2", "eagle3/fixed/k2"}
    assert "projection | target-only" in capsys.readouterr().out
    shape = tmp_path / "shape"  # the same step rows as the e2e run's own projection line (bench/projection.py)
    assert (
        main(
            [
                "bench",
                "project",
                "--shape",
                "--step",
                str(step / "summary.json"),
                "--acceptance",
                str(e2e_out / "summary.json"),
                "--out",
                str(shape),
            ]
        )
        == 0
    )
    projected = _read(shape)
    assert_schema(projected, "project-shape")
    assert projected["projection"]["label"] == "projection" and projected["projection"]["methods"]


def test_step_takes_a_demo_at_name(tmp_path):
    out = tmp_path / "step"
    assert (
        main(
            [
                "bench",
                "step",
                "--model",
                "demo@small-moonlight:5",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--no-graphs",
                "--contexts",
                "4",
                "--max-k",
                "0",
                "--reps",
                "1",
                "--eager-reps",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (res,) = _read(out)["results"]
    assert "error" not in res, res
    assert res["model"] == "demo@small-moonlight:5" and res["layers"] == 5 and res["rows"][0]["graph_ms"] > 0


def test_draft_goes_through_draft_profiles_entry_point(tmp_path):
    out = tmp_path / "draft"
    assert (
        main(
            [
                "bench",
                "draft",
                "--drafters",
                "ngram",
                "--max-new-tokens",
                "4",
                "--top",
                "2",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = _read(out)
    assert_schema(summary, "draft")
    (row,) = summary["rows"]
    assert row["drafter"] == "ngram" and row["proposes"] > 0
    assert json.loads((out / "draft_profile.json").read_text())["rows"] == summary["rows"]


def test_e2e_summary_has_the_schema(bench_run):
    _, summary = bench_run
    assert_schema(summary, "e2e")
    assert summary["environment"]["bandwidth"]["bytes_per_s"] > 0 and summary["methods"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["kernels", "--device", "cpu"], "bench kernels times Triton and FlashInfer kernels; it needs --device cuda"),
        (["kernels", "--suite", "moe,bogus", "--device", "cpu"], "--suite: choose from moe, quant"),
        (["kernels", "--suite", "moe", "--gemv-sweep", "--device", "cpu"], "--gemv-sweep runs in the quant suite"),
        (["step", "--census", "--device", "cpu"], "needs a CUDA GPU"),
        (
            [
                "step",
                "--model",
                "demo@no-such-model",
                "--device",
                "cpu",
                "--no-graphs",
                "--contexts",
                "4",
                "--max-k",
                "0",
                "--reps",
                "1",
                "--eager-reps",
                "0",
            ],
            None,
        ),
        (["project", "--step", "/nonexistent/summary.json", "--acceptance", "/nonexistent/s.json"], "does not exist"),
        (["draft", "--drafters", "ngram,medusa"], "--drafters: choose from"),
        (["draft", "--model", "demo@no-such-model"], "--model demo@no-such-model"),
        (["kernels", "--suite", "allreduce", "--world-size", "1", "--device", "cpu"], "--world-size must be >= 2"),
    ],
)
def test_refusals_are_one_line(argv, message, tmp_path, capsys):
    rc = main(["bench", *argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    if message is None:  # a model that cannot build: its error in the summary, the others' rows kept, exit 1
        assert rc == 1 and "error" in _read(tmp_path / "out")["results"][0]
        return
    assert rc == 2 and len(err) == 1 and err[0].startswith("specserve bench: error:") and message in err[0], err


def test_bare_bench_is_e2e(bench_target, tmp_path):
    argv = ["--model", str(bench_target), "--prompts", "2", "--fixed-k", "1,2", "--out", str(tmp_path)]
    parser, _ = build_parser(["bench", *argv])
    bare = parser.parse_args(["bench", *argv])
    parser, _ = build_parser(["bench", "e2e", *argv])
    named = parser.parse_args(["bench", "e2e", *argv])
    assert bare.bench_command is None and named.bench_command == "e2e"
    assert {k: v for k, v in vars(bare).items() if k != "bench_command"} == {
        k: v for k, v in vars(named).items() if k != "bench_command"
    }


def _doc_commands() -> list[tuple[str, list[str]]]:
    out = []
    for name in DOCS:
        text = (ROOT / name).read_text(encoding="utf-8")
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith("specserve bench") and not re.search(r"(^|\s)\.\.\.(\s|$)", line):
                    out.append((name, shlex.split(line, comments=True)[1:]))
        for inline in re.findall(r"`((?:OMP_NUM_THREADS=1 )?specserve bench [^`]*)`", text):
            if "..." not in inline and "[" not in inline and "DIR" not in inline:  # a template, not a command
                out.append((name, shlex.split(inline.removeprefix("OMP_NUM_THREADS=1 "))[1:]))
    return out


def test_every_bench_command_the_docs_quote_parses():
    commands = _doc_commands()
    subs = {argv[1] for _, argv in commands if len(argv) > 1 and not argv[1].startswith("-")}
    assert {"step", "project", "overhead", "draft", "kernels"} <= subs, subs
    for name, argv in commands:
        parser, mod = build_parser(argv)
        assert mod is not None, (name, argv)
        parser.parse_args(argv)  # an unknown flag or a bad value exits 2 here, naming it


def test_no_doc_names_a_module_that_went_behind_the_front_door():
    for name in DOCS:
        text = (ROOT / name).read_text(encoding="utf-8")
        for module in MOVED:
            assert f"-m specserve.bench.{module}" not in text, f"{name} still runs python -m specserve.bench.{module}"
