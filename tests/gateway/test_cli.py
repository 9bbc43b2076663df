"""`specserve serve` (three processes) + `specserve client` against `specserve generate` in one process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from service_helpers import Proc, base_env

from specserve.cli.main import main

PROMPT_IDS = "5,17,99,5,17,3,42,7,5,17"
ADMIN = "operator-secret"  # serve's --admin-token


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def served(tiny_target_dir):
    proc = Proc(
        "serve",
        [
            "--model",
            str(tiny_target_dir),
            "--draft",
            "ngram",
            "--port",
            "0",
            "--admin-token",
            ADMIN,
            "--progress-every-s",
            "0.2",
        ],
        base_env(),
        merge_stderr=False,
    )
    line = proc.wait_line("gateway listening on ", timeout=240)
    yield proc, line.split()[-1]
    proc.stop()


def test_client_json_matches_generate(served, tiny_target_dir, capsys):
    _, address = served
    flags = ["--prompt-ids", PROMPT_IDS, "--max-new-tokens", "20", "--temperature", "0", "--json"]
    code, out, _ = run_cli(capsys, "client", "--gateway", address, *flags)
    assert code == 0
    remote = json.loads(out)
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_target_dir), "--draft", "ngram", *flags)
    assert code == 0
    local = json.loads(out)
    assert remote["token_ids"] == local["token_ids"] and len(remote["token_ids"]) == 20
    assert remote["text"] == local["text"] and remote["finish_reason"] == local["finish_reason"] == "length"
    assert remote["stats"].keys() == local["stats"].keys()
    assert {"steps", "mean_accepted_length", "accepted_per_position", "tokens_per_s", "ttft_s"} <= remote[
        "stats"
    ].keys()
    assert remote["stats"]["accepted_per_position"] == local["stats"]["accepted_per_position"]
    # a text prompt through the gateway's tokenizer, and target-only: the same tokens again
    code, out, _ = run_cli(
        capsys,
        "client",
        "--gateway",
        address,
        "--prompt",
        "hello",
        "--max-new-tokens",
        "5",
        "--draft",
        "none",
        "--json",
    )
    assert code == 0 and len(json.loads(out)["token_ids"]) == 5


# a client process: one request through the gateway, then which heavy modules it loaded
_CLIENT_LOADS = """
import sys
from specserve.cli.main import main
code = main(["client", "--gateway", sys.argv[1], "--prompt-ids", "1,2,3", "--max-new-tokens", "1", "--json"])
print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
sys.exit(code)
"""


def test_client_never_loads_torch_or_numpy(served):
    """`specserve client` speaks only the wire: neither torch nor numpy is imported for a request (they cost seconds
    of a one-token request's wall time), yet the request is served."""
    _, address = served
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT_LOADS, address], capture_output=True, text=True, timeout=60, env=base_env()
    )
    assert out.returncode == 0, out.stderr
    reply, loaded = out.stdout.strip().splitlines()
    assert len(json.loads(reply)["token_ids"]) == 1
    assert loaded == "[]"


def test_client_admin_and_errors(served, capsys, monkeypatch):
    proc, address = served
    monkeypatch.delenv("SPECSERVE_ADMIN_TOKEN", raising=False)
    code, out, _ = run_cli(capsys, "client", "--gateway", address, "--list-drafts")
    assert code == 0 and list(json.loads(out)) == ["ngram"]
    # serve --admin-token reaches the gateway: without the token SetDraft is refused, one line, no traceback
    swap = ["client", "--gateway", address, "--set-draft", "x=unix:/nonexistent/d.sock", "--timeout", "3"]
    code, out, err = run_cli(capsys, *swap)
    assert code != 0 and err.count("\n") == 1 and "PERMISSION_DENIED" in err and "Traceback" not in err
    assert "missing or wrong admin token" in err
    # ... with it, the swap is tried, fails (nothing listens there) and is logged as a failure
    code, out, err = run_cli(capsys, *swap, "--admin-token", ADMIN)
    assert code != 0 and "FAILED_PRECONDITION" in err and "no draft service reachable" in err
    deadline = time.monotonic() + 10
    while not any("SetDraft 'x'" in line for line in proc.err_lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    (logged,) = [line for line in proc.err_lines if "SetDraft 'x'" in line]
    assert "failed: FAILED_PRECONDITION: address: no draft service reachable" in logged, logged
    code, _, err = run_cli(capsys, "client", "--gateway", address, "--prompt-ids", "1,2", "--draft", "nosuch")
    assert code != 0 and err.count("\n") == 1 and "INVALID_ARGUMENT: draft:" in err
    code, _, err = run_cli(capsys, "client", "--gateway", address, "--max-new-tokens", "3")
    assert code != 0 and err.count("\n") == 1 and "--prompt" in err
    code, _, err = run_cli(capsys, "client", "--gateway", "127.0.0.1:1", "--prompt-ids", "1,2", "--timeout", "2")
    assert code != 0 and err.count("\n") == 1 and "Traceback" not in err


def test_serve_says_what_it_waits_for_while_it_starts(served):
    """A line every --progress-every-s while the services load (it was silent for 5-30 s)."""
    proc, _ = served
    waits = [line for line in proc.err_lines if line.startswith("specserve serve: waiting for the ")]
    assert any(
        line.startswith("specserve serve: waiting for the target to load its model and listen (") for line in waits
    ), proc.err_lines[:20]


def test_client_summary_is_a_line_of_its_own(served):
    """The streamed completion, its newline, then the summary line (on stderr): in that order even when stdout
    and stderr are one pipe, as in `specserve client ... 2>&1 | tee log`."""
    import subprocess
    import sys

    _, address = served
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli.main",
            "client",
            "--gateway",
            address,
            "--prompt",
            "hello",
            "--max-new-tokens",
            "5",
            "--temperature",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        env={k: v for k, v in base_env().items() if k != "PYTHONUNBUFFERED"},
    )  # as a user runs it
    assert out.returncode == 0, out.stdout
    lines = out.stdout.splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("[5 tokens, ") and lines[-1].endswith("]"), out.stdout
    assert "[5 tokens" not in "".join(lines[:-1]), out.stdout


def test_serve_refuses_more_drafted_tokens_than_its_draft_drafts(served, capsys):
    """serve's draft drafts at most --max-block-size (8) per block: k = 16 is refused naming that flag
    (it was silently drafted as 8); k = 8 is served as asked."""
    _, address = served
    flags = ["--prompt-ids", PROMPT_IDS, "--max-new-tokens", "12", "--json"]
    code, _, err = run_cli(capsys, "client", "--gateway", address, *flags, "--num-speculative-tokens", "16")
    assert code == 2 and err.count("\n") == 1 and "INVALID_ARGUMENT: num_speculative_tokens: 16" in err
    assert "--max-block-size" in err
    code, out, _ = run_cli(capsys, "client", "--gateway", address, *flags, "--num-speculative-tokens", "8")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 12


def test_serve_prints_one_line_and_stops_all_three(served):
    """SIGTERM while a request streams: it still completes (drain), then all three processes exit."""
    import grpc

    from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc

    proc, address = served
    with grpc.insecure_channel(address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=200), timeout=60
        )
        first = next(call)
        t0 = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        rest = list(call)
    assert first.HasField("delta") and rest[-1].HasField("final")
    assert sum(len(m.delta.token_ids) for m in [first, *rest[:-1]]) == 200
    assert proc.stop(signal.SIGTERM, timeout=60) == 0
    assert time.monotonic() - t0 < 60
    assert len(proc.lines) == 1 and proc.lines[0].startswith("gateway listening on 127.0.0.1:")  # stdout
    for role in ("target", "draft", "gateway"):  # each child drained and exited on its own
        assert f"[{role}] {role} stopped" in proc.err_lines
    # stderr: whole lines, each named by the child it came from (a draft's ready line was glued onto a bar)
    assert any(line.startswith("[draft] draft (ngram) listening on unix:") for line in proc.err_lines)
    assert all(
        line.startswith(("[target] ", "[draft] ", "[gateway] ", "specserve serve: ")) for line in proc.err_lines
    ), proc.err_lines
    assert not any("\r" in line or "%|" in line for line in proc.err_lines)  # no progress bars
