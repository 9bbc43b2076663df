"""Rank 0's side of the rank group: start (or await) the workers, open the groups, stop them again.

Single host (no WORLD_SIZE in the environment): rank 0 hosts the store on a free loopback port and
starts ranks 1..N-1 itself through a multiprocessing forkserver (torch is imported once in the server,
so starting a group is cheap; no process inherits rank 0's threads or CUDA state). The workers exit
with rank 0 however it ends (they watch its pipe). Several hosts: every rank is started with the
env:// variables (see ARCHITECTURE.md, "Parallel target"); rank 0 waits for the others to join.
"""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import torch

from specserve.target_service.parallel import rendezvous as rv
from specserve.target_service.parallel.protocol import Channel, ShardSpec, Stop
from specserve.target_service.parallel.worker import spawned_worker

STORE_TIMEOUT = timedelta(minutes=10)
JOIN_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
WORKER_MODULE = "specserve.target_service.parallel.worker"


def _base_index(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


class RankGroup:
    """Rank 0's handle on the job: the control channel and (single host) the worker processes."""

    def __init__(self, spec: ShardSpec, device: str | torch.device) -> None:
        self.spec = spec
        self.procs: list[multiprocessing.Process] = []
        self.channel: Channel | None = None
        rv.ensure_no_group()
        rdv = rv.Rendezvous.from_env()
        requested = torch.device(device)
        try:
            if rdv is None or rdv.world_size == 1:
                self.device = rv.rank_device(requested.type, _base_index(requested))
                rdv = rv.Rendezvous("127.0.0.1", 0, 0, spec.tp_size, 0)
                store = rv.open_store(rdv, STORE_TIMEOUT)
                rdv = rv.Rendezvous(rdv.master_addr, store.port, 0, rdv.world_size, 0)
                rv.publish_spec(store, spec)
                self._spawn(rdv)
            else:
                self._check_env(rdv)
                self.device = rv.rank_device(requested.type, rdv.local_rank)
                store = rv.open_store(rdv, STORE_TIMEOUT)
                rv.publish_spec(store, spec)
            rv.wait_for_ranks(store, spec.tp_size, JOIN_TIMEOUT_S, self._check_alive)
            self.channel = Channel(rv.init_groups(store, rdv, self.device))
        except BaseException:
            self.close()
            raise

    def _check_env(self, rdv: rv.Rendezvous) -> None:
        if rdv.world_size != self.spec.tp_size:
            raise rv.ParallelError(
                f"WORLD_SIZE={rdv.world_size} but --tensor-parallel-size {self.spec.tp_size}: they must be equal"
            )
        if rdv.rank != 0:
            raise rv.ParallelError(
                f"this process is RANK={rdv.rank}; only rank 0 serves callers: start ranks >= 1 with "
                "`python -m specserve.cli.parallel_worker` (or specserve.cli.parallel_launch)"
            )

    def _spawn(self, rdv: rv.Rendezvous) -> None:
        rv.disable_multicast()  # inherited by the forkserver and its children
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([WORKER_MODULE])
        threads = max(1, (os.cpu_count() or 1) // rdv.world_size)
        base = _base_index(self.device)
        for rank in range(1, rdv.world_size):
            worker_rdv = rv.Rendezvous(rdv.master_addr, rdv.master_port, rank, rdv.world_size, rank)
            index = base + rank if self.spec.device_type == "cuda" else None
            if index is not None:
                rv.rank_device("cuda", index)  # refuse now when there are not enough GPUs
            proc = ctx.Process(
                target=spawned_worker, args=(worker_rdv, index, threads), name=f"specserve-tp-rank{rank}", daemon=True
            )
            proc.start()
            self.procs.append(proc)

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                raise rv.ParallelError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} while starting")

    def check_ready(self, error: str | None) -> None:
        """Startup barrier: every rank reports whether its shard loaded; raise if any did not."""
        assert self.channel is not None
        errors = [e for e in self.channel.gather_status(error) if e]
        if errors:
            self.channel = None  # the workers have left already: no Stop to send
            raise rv.ParallelError("parallel target failed to start: " + "; ".join(errors))

    def close(self) -> None:
        """Stop the workers (Stop command, then wait; kill stragglers) and leave the groups."""
        if self.channel is not None:
            try:
                self.channel.send(Stop())
            except Exception:  # a dead rank: the group is unusable, the processes are reaped below
                pass
            self.channel = None
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        self.procs = []
        rv.destroy_groups()
