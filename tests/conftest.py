"""Suite-wide settings: one torch thread per test process (tiny models gain nothing from more, and
CI has two cores shared with the service processes the tests start); and one pinned seed key for every target the
suite builds or starts, so that a seeded request draws the same values on every run, as it did before targets
keyed their seeds (a target's key is otherwise random per process: specserve/models/probs.py). The hostile tests
that need another key pass their own."""

import os
from pathlib import Path

import pytest
import torch

from specserve.models.probs import SEED_KEY_ENV

torch.set_num_threads(1)
os.environ.setdefault(SEED_KEY_ENV, "7e57" * 16)


# ------------------------------------------------------------------------------ two workers (pytest-xdist)
# `make test` runs the suite on one worker; `-n 2 --dist loadgroup` (pytest-xdist) runs it on two. Tests that
# start service processes or make shared-memory names run one at a time, on one worker (the xdist group
# "services"): their checks that no name is left in /dev/shm see every process's names, and their deadlines and
# timing comparisons want no second stack beside them. Every test under tests/gateway/ and tests/runtime/ is in it but the in-process ones named here, and
# so are the service tests named below from the other folders; the rest spread over both workers. A new test that
# starts a service or makes a shared-memory name outside gateway/ and runtime/ goes in SERVICE_FILES.
SERVICE_FOLDERS = ("gateway", "runtime")
IN_PROCESS_FILES = frozenset(
    {
        "test_adaptive_replay.py",
        "test_admission.py",
        "test_convert.py",
        "test_engine_thread.py",
        "test_openai_schema.py",
        "test_prompt_reads.py",
        "test_scrape_cache.py",
        "test_spec_loop.py",
        "test_validation.py",
        "test_console_telemetry.py",
        "test_device_stream.py",
        "test_session_host.py",
        "test_step_span.py",
        "test_worker.py",
    }
)
SERVICE_FILES = frozenset(
    {
        "test_bench_via.py",
        "test_cli_errors.py",
        "test_readme_commands.py",
        "test_ring_rtt.py",
        "test_serve_overhead.py",
        "test_parallel_processes.py",
        "test_target_hostile.py",
        "test_target_server.py",
        "test_draft_hostile.py",
        "test_draft_server.py",
    }
)
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    services = pytest.mark.xdist_group("services")
    for item in items:
        rel = item.path.resolve().relative_to(TESTS)
        in_folder = rel.parts[0] in SERVICE_FOLDERS and rel.name not in IN_PROCESS_FILES
        if in_folder or rel.name in SERVICE_FILES:
            item.add_marker(services)
