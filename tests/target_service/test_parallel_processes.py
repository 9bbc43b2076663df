"""Parallel target across separate processes: the env:// (multi-host) start on loopback, workers that
end with rank 0, and a TP=2 target behind `specserve serve` (gateway, draft and target processes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from specserve.cli.main import main

REPO = Path(__file__).resolve().parents[2]
PROMPT_IDS = "3,17,99,5,42,7,8,250,1,64,9"
FLAGS = ["--prompt-ids", PROMPT_IDS, "--max-new-tokens", "10", "--temperature", "0", "--json"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate_json(capsys, ckpt: Path, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--num-kv-blocks", "64", *FLAGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_env_rendezvous_start_on_loopback(tiny_checkpoint, capsys):
    """Both ranks started by hand with the env:// variables (as on two hosts), one command line."""
    ckpt = tiny_checkpoint("deepseek_v3")
    want = _generate_json(capsys, ckpt, "--draft", "ngram")["token_ids"]
    port = str(_free_port())
    common = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    argv = [
        sys.executable,
        "-m",
        "specserve.cli.parallel_launch",
        "generate",
        "--model",
        str(ckpt),
        "--num-kv-blocks",
        "64",
        "--tensor-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--draft",
        "ngram",
        *FLAGS,
    ]
    worker = subprocess.Popen(
        argv,
        env=_env(RANK="1", LOCAL_RANK="1", **common),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rank0 = subprocess.run(
        argv, env=_env(RANK="0", LOCAL_RANK="0", **common), cwd=REPO, capture_output=True, text=True, timeout=240
    )
    out, err = worker.communicate(timeout=60)
    assert rank0.returncode == 0, rank0.stderr[-2000:]
    assert json.loads(rank0.stdout)["token_ids"] == want
    assert worker.returncode == 0 and out == "", err[-2000:]  # stopped by rank 0, printed nothing


def test_a_worker_rank_needs_the_env_variables(monkeypatch, capsys):
    from specserve.cli.parallel_worker import main as worker_main

    monkeypatch.delenv("RANK", raising=False)
    assert worker_main([]) == 2 and "set RANK" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert worker_main([]) == 2  # rank 0 is the serving process, not a worker


SCRIPT = """
import os, sys
from specserve.target_service.parallel.engine import ParallelTargetEngine
engine = ParallelTargetEngine(sys.argv[1], tensor_parallel_size=2, num_blocks=16, block_size=4, progress=False)
engine.generate_greedy([1, 2, 3], 2)
print(" ".join(str(p.pid) for p in engine._group.procs), flush=True)
os.kill(os.getpid(), 9)
"""


def test_workers_end_when_rank_zero_is_killed(tiny_checkpoint):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint("qwen3_moe"))],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_tp2_target_behind_the_gateway_matches_generate(tiny_checkpoint, capsys):
    ckpt = tiny_checkpoint("qwen3_moe")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specserve.cli.main",
            "serve",
            "--model",
            str(ckpt),
            "--draft",
            "ngram",
            "--port",
            "0",
            "--tensor-parallel-size",
            "2",
            "--num-kv-blocks",
            "64",
        ],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(serve.stderr), daemon=True).start()
    try:
        line = serve.stdout.readline()
        assert line.startswith("gateway listening on "), "".join(errors)[-3000:]
        address = line.split()[-1]
        capsys.readouterr()
        assert main(["client", "--gateway", address, *FLAGS]) == 0
        remote = json.loads(capsys.readouterr().out)
        local = _generate_json(capsys, ckpt, "--draft", "ngram")
        assert remote["token_ids"] == local["token_ids"] and len(local["token_ids"]) == 10
        assert remote["stats"]["accepted_per_position"] == local["stats"]["accepted_per_position"]
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            assert serve.wait(timeout=60) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
