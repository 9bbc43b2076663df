"""The test-side launcher (service_helpers.Proc) leaves no service behind when the test run is killed: a
script that starts a draft service through it, as a fixture does, gets SIGTERM (the default action: no
teardown, no atexit) or SIGKILL, and the service is gone within seconds. Before, it went on serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from service_helpers import Proc, base_env, wait_until

HERE = Path(__file__).resolve().parent
STARTER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from service_helpers import Proc, base_env
proc = Proc("draft", ["--draft", "ngram", "--listen", "unix:" + sys.argv[2], "--grace-s", "0.5"], base_env())
proc.wait_line("draft (ngram) listening on ", timeout=60)
print(proc.popen.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an orphan's zombie may wait for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _descendants(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids.update(int(c) for c in (task / "children").read_text().split())
    return kids | {d for k in kids for d in _descendants(k)}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_test_run_leaves_no_service(tmp_path, sig):
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(HERE), str(tmp_path / "d.sock")],
        stdout=subprocess.PIPE,
        text=True,
        env=base_env(),
    )
    service = None
    try:
        service = int(starter.stdout.readline())
        started = _descendants(starter.pid)
        assert service in started
        starter.send_signal(sig)
        assert starter.wait(10) == -sig
        wait_until(
            lambda: not any(_alive(p) for p in started),
            5.0,
            lambda: f"processes the killed run started still run: {[p for p in started if _alive(p)]}",
        )
    finally:
        starter.kill()
        starter.wait()
        if service is not None and _alive(service):
            os.kill(service, signal.SIGKILL)


def test_a_proc_starts_on_the_main_thread_only():
    """A child dies with the thread that started it, so a Proc from a passing thread is refused."""
    errors = []

    def start():
        try:
            Proc("draft", ["--help"], base_env())
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(10)
    assert errors and "main thread" in errors[0]
