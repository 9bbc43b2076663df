"""What a user sees on bad input: one line on stderr naming the flag or the file, exit code 2, never a
traceback or argparse's whole usage (the CLI entry point, in process)."""

from __future__ import annotations

import shutil

import pytest

from specserve.cli.main import main


def _one_line_error(capsys, argv: list[str], prefix: str) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse exits
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["generate", "--prompt-ids", "1", "--draft", "foo"], "--draft"),
        (["generate", "--prompt-ids", "1", "--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
        (["generate", "--prompt-ids", "abc,1"], "--prompt-ids"),
        (["generate", "--prompt-ids", "1,,2"], "--prompt-ids"),  # was read as [1, 2]
        (["generate", "--prompt-ids", "1,2,"], "--prompt-ids"),
        (["client", "--prompt-ids", "1", "--max-new-tokens", "x"], "--max-new-tokens"),
        (["draft", "--draft", "nope"], "--draft"),
        (["draft", "--draft", "ngram", "--shm-spin-us", "-1"], "--shm-spin-us"),
        (["draft", "--draft", "ngram", "--shm-spin-us", "soon"], "--shm-spin-us"),
        (["target", "--graph-hidden-layers", "1,x"], "--graph-hidden-layers"),
        (["target", "--graph-hidden-layers", "-1"], "--graph-hidden-layers"),
        (["serve", "--max-output-tokens", "0"], "--max-output-tokens"),
    ],
)
def test_a_bad_flag_value_is_one_line_naming_the_flag(capsys, argv, flag):
    line = _one_line_error(capsys, argv, f"specserve {argv[0]}: error: {flag}: ")
    assert line.endswith("(see --help)")


def test_a_missing_flag_of_a_nested_command_is_one_line(capsys):
    line = _one_line_error(capsys, ["train", "target", "--out", "x"], "specserve train target: error: ")
    assert "--tokenizer" in line and line.endswith("(see --help)")


def _truncated(src, dst, file="model.safetensors"):
    """A copy of checkpoint folder src whose weights file is cut to half its size."""
    shutil.copytree(src, dst)
    data = (dst / file).read_bytes()
    (dst / file).write_bytes(data[: len(data) // 2])
    return dst / file


def test_a_truncated_target_checkpoint_under_generate_is_one_line(bench_target, tmp_path, capsys):
    cut = _truncated(bench_target, tmp_path / "target")
    line = _one_line_error(
        capsys, ["generate", "--model", str(cut.parent), "--prompt-ids", "1,2"], "specserve generate: error: "
    )
    assert str(cut) in line


@pytest.fixture(scope="module")
def bench_dflash(bench_target, tmp_path_factory):
    """A random DFlash drafter whose shapes fit bench_target (hidden 64, 3 layers, vocab 320)."""
    import torch
    from bench_helpers import TARGET

    from specserve.draft_service.dflash import DFlashConfig, DFlashModel, save_dflash

    torch.manual_seed(0)
    cfg = DFlashConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=TARGET["vocab_size"],
        block_size=5,
        target_hidden_size=TARGET["hidden_size"],
        target_layer_ids=(0, 2),
    )
    out = tmp_path_factory.mktemp("dflash") / "dflash"
    save_dflash(DFlashModel(cfg), out)
    return out


@pytest.mark.parametrize("family", ["eagle3", "dflash", "model"])
@pytest.mark.parametrize("command", ["generate", "draft"])
def test_a_truncated_drafter_checkpoint_is_one_line(
    bench_target, bench_eagle3, bench_dflash, bench_draft_lm, tmp_path, capsys, family, command
):
    cut = _truncated(
        {"eagle3": bench_eagle3, "dflash": bench_dflash, "model": bench_draft_lm}[family], tmp_path / family
    )
    argv = [command, "--model", str(bench_target), "--draft", family, "--draft-model", str(cut.parent)]
    if command == "generate":
        argv += ["--prompt-ids", "1,2"]
    else:
        argv += ["--listen", f"unix:{tmp_path}/draft.sock"]
    line = _one_line_error(capsys, argv, f"specserve {command}: error: ")
    assert str(cut) in line


def test_generate_refuses_more_new_tokens_than_the_context_holds(bench_target, capsys):
    """As the gateway refuses it (client): up front, one line (generate ran to the context's end, exit 0)."""
    line = _one_line_error(
        capsys,
        ["generate", "--model", str(bench_target), "--prompt-ids", "1,2", "--max-new-tokens", "100000000"],
        "specserve generate: error: --max-new-tokens: ",
    )
    assert "context of 1024" in line


@pytest.mark.parametrize("command", ["generate", "target", "draft", "serve"])
@pytest.mark.parametrize("device", ["gpu", "tpu", "cuda:x"])
def test_an_unknown_device_is_one_line(capsys, command, device):
    argv = [command, "--device", device] + (["--prompt-ids", "1"] if command == "generate" else [])
    line = _one_line_error(capsys, argv, f"specserve {command}: error: --device: ")
    assert f"expected cpu, cuda or cuda:N, got {device!r}" in line


def test_a_bad_given_commit_is_one_line_before_the_bench_measures(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_GIT_COMMIT", "main")
    line = _one_line_error(
        capsys,
        ["bench", "overhead", "--ring", "--n", "5", "--out", str(tmp_path)],
        "specserve bench: error: SPECSERVE_GIT_COMMIT: 'main' is not a commit",
    )
    assert "git describe --always --dirty" in line and not (tmp_path / "summary.json").exists()


def test_float32_on_cuda_is_refused_before_anything_loads(capsys):
    """The 40x eager cliff is refused in one line, decided from the flags alone (so a CPU machine shows it);
    --dtype auto is bfloat16 on CUDA."""
    from specserve.cli.common import check_target_placement, dtype_for

    line = _one_line_error(
        capsys,
        ["generate", "--device", "cuda", "--dtype", "float32", "--prompt-ids", "1"],
        "specserve generate: error: --dtype float32 on CUDA: ",
    )
    assert "without CUDA graphs" in line and "use --dtype bfloat16" in line
    _one_line_error(
        capsys, ["serve", "--device", "cuda:0", "--dtype", "float32"], "specserve serve: error: --dtype float32"
    )
    assert (dtype_for("cuda", "auto"), dtype_for("cuda:1", "auto"), dtype_for("cpu", "auto")) == (
        "bfloat16",
        "bfloat16",
        "float32",
    )
    assert (
        check_target_placement("cpu", "auto") == "float32" and check_target_placement("cpu", "bfloat16") == "bfloat16"
    )


def test_an_unknown_flag_is_named_before_a_missing_one(capsys):
    line = _one_line_error(capsys, ["generate", "--bogus"], "specserve generate: error: ")
    assert line == "specserve generate: error: unrecognized arguments: --bogus (see --help)"
    line = _one_line_error(capsys, ["train", "target", "--out", "x"], "specserve train target: error: ")
    assert "--tokenizer" in line  # a missing flag with no unknown one is still named


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    flat = " ".join(out.split())
    for shown in (
        "--num-kv-blocks NUM_KV_BLOCKS default: 4096",
        "--max-new-tokens MAX_NEW_TOKENS default: 64",
        "--draft {none,ngram,model,eagle3,dflash,dspark,mtp} default: none",
        "(default: cpu)",
    ):
        assert shown in flat, shown


def test_a_k_with_draft_none_warns(capsys):
    assert (
        main(
            ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--num-speculative-tokens", "100", "--json"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "specserve generate: warning: --num-speculative-tokens 100 has no effect with --draft none "
        "(target-only decoding)"
    ) in err
    assert main(["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("command", [["target"], ["draft", "--draft", "ngram"], ["serve"]])
def test_a_busy_port_is_one_line_before_the_model_loads(command):
    """A real process, as a user starts it: gRPC's own log line and the interpreter's excepthook noise never
    show, and the refusal comes before the checkpoint is read."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        flag = ["--listen", f"127.0.0.1:{port}"] if command[0] in ("target", "draft") else ["--port", str(port)]
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "specserve.cli.main", *command, *flag],
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        )
        took = time.monotonic() - t0
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines == [
        f"specserve {command[0]}: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], out.stderr
    assert took < 30


def test_serve_splits_its_cores_between_its_three_processes():
    """Three full thread pools on a small host starve each other (the issue: 1.5-14 tok/s served against 113
    in process on 2 cores); serve gives each process its share."""
    from specserve.cli.common import split_threads

    assert split_threads(2, "model") == (1, 1, 1)  # target, draft, gateway
    assert split_threads(2, "none") == (1, 1, 1)
    assert split_threads(16, "ngram") == (14, 1, 1)
    assert split_threads(16, "eagle3") == (11, 4, 1)
    assert split_threads(1, "dflash") == (1, 1, 1)


def test_threads_sizes_the_process_pool(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        assert main(["generate", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--threads", "1", "--json"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    import socket

    with socket.socket() as holder:  # a flag's error is decided from the flags: before the port is checked
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        _one_line_error(
            capsys,
            ["serve", "--threads", "-1", "--host", "127.0.0.1", "--port", str(port)],
            "specserve serve: error: --threads must be >= 0",
        )
