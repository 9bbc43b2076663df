"""Where the ranks of one tensor/expert-parallel target meet: env:// variables, the TCP store, groups.

Rank 0 (the process that serves callers) hosts the TCP store at MASTER_ADDR:MASTER_PORT, as
torch.distributed's env:// rendezvous does; the other ranks connect to it. Two process groups:
  * the default group (NCCL on GPUs, gloo on CPU) carries the model's all-reduces and gathers;
  * a gloo "control" group carries rank 0's step commands (pickled, CPU). It has a very long timeout,
    since workers wait on it while the service is idle.
Every process that takes part turns NVLink multicast off before NCCL starts (``disable_multicast``).
"""

from __future__ import annotations

import gc
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.errors import SpecserveError

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CONTROL_TIMEOUT = timedelta(days=365)  # idle services: workers block on the control group between steps
JOIN_KEY = "specserve/joined/{rank}"
SPEC_KEY = "specserve/spec"


class ParallelError(SpecserveError):
    """A tensor-parallel target could not start, lost a rank, or was given an impossible placement."""


def disable_multicast() -> None:
    """NVLink multicast (NVLS / symmetric-memory multicast) off for this process and its children."""
    os.environ.update(MULTICAST_OFF)


@dataclass(frozen=True)
class Rendezvous:
    """One rank's view of the job (the env:// variables)."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    local_rank: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ParallelError(f"need 0 <= RANK < WORLD_SIZE, got RANK={self.rank} WORLD_SIZE={self.world_size}")
        if not 0 <= self.master_port < 2**16:
            raise ParallelError(f"MASTER_PORT must be in [0, 65535], got {self.master_port}")
        if self.local_rank < 0:
            raise ParallelError(f"LOCAL_RANK must be >= 0, got {self.local_rank}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Rendezvous | None:
        """The env:// variables when WORLD_SIZE and RANK are set (multi-host or torchrun), else None."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env or "RANK" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            port = int(env.get("MASTER_PORT", "29500"))
            local = int(env.get("LOCAL_RANK", env["RANK"]))
        except ValueError as e:
            raise ParallelError(f"bad torch.distributed environment variable: {e}") from None
        return cls(env.get("MASTER_ADDR", "127.0.0.1"), port, rank, world, local)


def open_store(rdv: Rendezvous, timeout: timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store (unless torchrun's agent already does); the others connect (and retry)."""
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = rdv.rank == 0 and not agent_hosts
    try:
        return dist.TCPStore(
            rdv.master_addr, rdv.master_port, rdv.world_size, is_master, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise ParallelError(
            f"cannot {'host' if is_master else 'reach'} the store at {rdv.master_addr}:{rdv.master_port}: {e}"
        ) from e


def wait_for_ranks(
    store: dist.TCPStore,
    world_size: int,
    timeout_s: float,
    check_alive: Callable[[], None] = lambda: None,
) -> None:
    """Rank 0: wait until every other rank has announced itself (check_alive raises if one died)."""
    keys = [JOIN_KEY.format(rank=r) for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise ParallelError(f"ranks {', '.join(missing)} did not join within {timeout_s:.0f} s")
        time.sleep(0.05)


def announce(store: dist.TCPStore, rank: int) -> None:
    store.set(JOIN_KEY.format(rank=rank), "1")


def publish_spec(store: dist.TCPStore, spec: object) -> None:
    store.set(SPEC_KEY, pickle.dumps(spec))


def read_spec(store: dist.TCPStore):  # -> protocol.ShardSpec
    """Blocks until rank 0 has published the spec (the store's timeout bounds the wait)."""
    return pickle.loads(store.get(SPEC_KEY))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def ensure_no_group() -> None:
    """One parallel target per process: it owns torch.distributed's default group."""
    if dist.is_initialized():
        gc.collect()  # a parallel engine nobody references any more leaves the groups when collected
    if dist.is_initialized():
        raise ParallelError(
            "torch.distributed is already initialised in this process (close the other parallel target first)"
        )


def init_groups(store: dist.TCPStore, rdv: Rendezvous, device: torch.device) -> dist.ProcessGroup:
    """Create the default group (model collectives) and return the gloo control group."""
    ensure_no_group()
    disable_multicast()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), store=dist.PrefixStore("default_pg", store), rank=rdv.rank, world_size=rdv.world_size
    )
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device_type: str, index: int) -> torch.device:
    """The device of a rank: cpu, or cuda:index (checked against the visible GPUs)."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise ParallelError(f"tensor parallelism runs on cpu or cuda, not {device_type!r}")
    count = torch.cuda.device_count()
    if index >= count:
        raise ParallelError(f"rank needs cuda:{index} but only {count} GPU(s) are visible")
    return torch.device("cuda", index)
