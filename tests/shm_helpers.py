"""What a process maps of shared memory, read from /proc (the #44 tests: the segments a service still maps after a
refusal; what a hostile drafter keeps is specserve/bench/soak_hostile.segment_fds)."""

from __future__ import annotations

from specserve.runtime.shm_layout import SHM_DIR

SEGMENT_TAGS = ("/memfd:", str(SHM_DIR / "specserve-"))  # how a memfd and a named segment show in /proc


def mapped_segments(pid: int) -> list[str]:
    """The shared-memory segments process ``pid`` maps now (one line of /proc/<pid>/maps each)."""
    with open(f"/proc/{pid}/maps") as f:
        return [line.strip() for line in f if any(tag in line for tag in SEGMENT_TAGS)]


def left_behind(before: set[str], settle_s: float = 10.0) -> set[str]:
    """Names in /dev/shm that appeared since ``before`` (``leftover_names()`` then) and stay there. A shared machine
    runs other suites and services that make and remove their own names meanwhile, so a new name counts only if it
    is still there after up to ``settle_s`` seconds (one this test left stays for good)."""
    import time

    from specserve.runtime.shm_layout import leftover_names

    deadline = time.monotonic() + settle_s
    new = set(leftover_names()) - before
    while new and time.monotonic() < deadline:
        time.sleep(0.1)
        new &= set(leftover_names())
    return new
