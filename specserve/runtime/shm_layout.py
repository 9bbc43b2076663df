"""A shared-memory channel's segment at rest (specserve/runtime/shm_ring.py is the channel, shm_rings.py its
rings): where each word of it lives, the u32 length prefix, the sizes and spin a channel end is made with
(``RingConfig``), and the one name a channel has in /dev/shm (its hand-over socket: unlinked, listed).

Layout of the segment (``RingConfig.capacity`` = C bytes per direction)::

    [0, 512)          control: per ring a head (bytes written, u64) and a tail (bytes read, u64), each on
                      its own cache line, a "writer waits for room" flag, and the largest message its
                      reader accepts (u64, written by the reader at create / attach)
    [512, 512 + C)    ring 0: creator -> attacher
    [512 + C, 512+2C) ring 1: attacher -> creator

The segment is a sealed memfd (specserve/runtime/shm_memfd.py): it has no name, its pages are allocated when it
is made (no room is an OSError then, and that session stays on gRPC, never a SIGBUS later), and nobody, its
creator included, can shrink it under a peer's mapping. The attacher gets its descriptor over the channel's socket
and checks its seals and size before mapping it.

Names and leaks: the channel's one name is its socket, ``specserve-<random token>`` in /dev/shm (mode 0600). The
creator removes it when it takes the attacher (the attacher removes it too, once it holds the segment), so once
both sides hold the channel nothing is left by name and a SIGKILL of either side leaves nothing. A creator whose
peer never attaches removes it itself (``ShmChannel.close``: the service does at its attach timeout, or as soon as
the session's steps come over gRPC instead). Only a creator killed while its offer waits for an attacher that
never comes leaves the name (a socket: no memory stays with it).
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "specserve-"
CONTROL = 512
RING_CTRL = (0, 256)  # control block offset of ring 0, ring 1
HEAD, TAIL, WAITING, LIMIT = 0, 64, 128, 192  # offsets inside a ring's control block
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
LEN = 4
MAX_MESSAGE = (1 << 32) - 1  # what a u32 length can say
DEFAULT_MAX_MESSAGE = 512 * 1024 * 1024  # a reader's default limit: the services' gRPC one (servers_common)


def default_spin_us() -> float:
    """Spin only where cores are plenty: on a 2-core machine the spinning reader takes the core its
    peer needs (specserve/bench/ring_rtt.py measured the doorbell alone faster there, BENCHMARKS.md)."""
    return 20.0 if (os.cpu_count() or 1) >= 8 else 0.0


@dataclass(frozen=True)
class RingConfig:
    capacity: int = 1 << 20  # bytes per direction; larger messages stream through in pieces
    spin_us: float = field(default_factory=default_spin_us)  # spin on the ring before blocking on the doorbell
    max_message: int = DEFAULT_MAX_MESSAGE  # the largest message this end reads (a longer one drops the channel)

    def __post_init__(self) -> None:
        if self.capacity < 64 or self.capacity % 8:
            raise ValueError(f"capacity must be a multiple of 8 and >= 64, got {self.capacity}")
        if not 1 <= self.max_message <= MAX_MESSAGE:
            raise ValueError(f"max_message must be in [1, {MAX_MESSAGE}], got {self.max_message}")
        if self.spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {self.spin_us}")


def unlink_names(name: str) -> None:
    """Remove a channel's name (its hand-over socket) if it is still there."""
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()


def leftover_names() -> list[str]:
    """What channels and hidden-row servers left in /dev/shm (tests assert it is nothing)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(NAME_PREFIX))
