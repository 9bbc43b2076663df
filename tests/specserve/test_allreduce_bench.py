"""specserve.bench.allreduce_bench (`specserve bench kernels --suite allreduce`) on CPU: two real gloo ranks (spawned processes) through the same code path the
GPU run takes (NCCL, CUDA graphs) apart from the backend and the clock."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.bench import allreduce_bench
from specserve.cli.main import main as cli_main


def main(argv: list[str]) -> int:
    return cli_main(["bench", "kernels", "--suite", "allreduce", *argv])


def test_two_gloo_ranks_time_every_width(tmp_path, capsys):
    argv = [
        "--device",
        "cpu",
        "--world-size",
        "2",
        "--tokens",
        "1,3",
        "--hidden",
        "64",
        "--vocab",
        "100",
        "--reps",
        "3",
        "--calls",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "allreduce.json").read_text())
    assert json.loads((tmp_path / "summary.json").read_text())["suites"]["allreduce"] == report
    assert report["schema"] == allreduce_bench.SCHEMA and report["label"] == "measurement"
    assert (report["world_size"], report["backend"], report["hidden"]) == (2, "gloo", 64)
    assert report["env"]["NCCL_NVLS_ENABLE"] == "0"  # NVLink multicast off, as the serving ranks keep it
    assert [(p["tokens"], p["bytes"], p["mode"], p["samples"]) for p in report["all_reduce"]] == [
        (1, 1 * 64 * 2, "eager", 3),
        (3, 3 * 64 * 2, "eager", 3),
    ]  # [T, hidden] bf16
    assert [p["bytes"] for p in report["all_gather_logits"]] == [1 * 50 * 4, 3 * 50 * 4]  # [T, ceil(V / N)] fp32
    for p in report["all_reduce"] + report["all_gather_logits"]:
        assert 0 < p["p10_us"] <= p["median_us"] <= p["p90_us"]
    out = capsys.readouterr().out
    assert "T=  1 all_reduce" in out and "T=  3 all_reduce" in out


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal on a host without 2 GPUs")
def test_too_few_gpus_is_one_line(tmp_path, capsys):
    assert main(["--world-size", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("specserve bench: error: "), err
    assert "--world-size 2 needs 2 GPUs" in err or "no CUDA device here" in err, err  # 1 GPU / none


def test_bad_flags_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tokens", "1,x", "--device", "cpu"])
    assert exc.value.code == 2 and "--tokens" in capsys.readouterr().err
    for argv in (["--tokens", "0"], ["--world-size", "1"], ["--reps", "0"]):
        assert main([*argv, "--device", "cpu", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("specserve bench: error:"), err


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_nccl_ranks_on_gpus(tmp_path):
    argv = ["--world-size", "2", "--tokens", "1,16", "--reps", "5", "--calls", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "allreduce.json").read_text())
    assert report["backend"] == "nccl" and {p["mode"] for p in report["all_reduce"]} <= {"cuda_graph", "eager"}
    assert [p["bytes"] for p in report["all_reduce"]] == [7168 * 2, 16 * 7168 * 2]
