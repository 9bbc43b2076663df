"""Ranks 1..N-1 of a parallel target: load this rank's shard, then run rank 0's commands until Stop.

Started either by rank 0 itself (``spawned_worker``, one process per local rank) or by hand / torchrun
on any host with the env:// variables set::

    RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=host0 MASTER_PORT=29500 \\
        python -m specserve.cli.parallel_worker [--model /path/if/mounted/elsewhere]
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from specserve.models.config import ParallelConfig
from specserve.models.dtypes import DTYPES
from specserve.models.kv_cache import PagedKVCache
from specserve.models.loader import load_model
from specserve.target_service.parallel import rendezvous as rv
from specserve.target_service.parallel.protocol import (
    Channel,
    CopySlots,
    Forward,
    Logits,
    ShardSpec,
    Stop,
)

STORE_TIMEOUT = timedelta(minutes=10)


def load_shard(spec: ShardSpec, rank: int, device: torch.device, progress: bool = False):
    """(model, ModelConfig): this rank's slices of the checkpoint, with the spec's compute backends."""
    from specserve.models.backends import BackendChoice, install_backends

    parallel = ParallelConfig(tp_rank=rank, tp_size=spec.tp_size, ep=spec.expert_parallel)
    dtype = DTYPES[spec.dtype]
    model, config = load_model(spec.checkpoint, device, dtype, parallel, progress=progress)
    install_backends(model, BackendChoice(spec.attention_backend, spec.moe_backend), spec.block_size, device, dtype)
    return model, config


class _Shard:
    """This rank's model shard and cache, driven by commands."""

    def __init__(self, spec: ShardSpec, rank: int, device: torch.device) -> None:
        self.device = device
        self.model, self.config = load_shard(spec, rank, device)
        self.dtype = DTYPES[spec.dtype]
        self.cache = PagedKVCache(
            self.config.num_layers, spec.num_blocks, spec.block_size, self.model.kv_entry_shape(), self.dtype, device
        )

    def run(self, cmd: object) -> None:
        if isinstance(cmd, Forward):
            ids, pos, attn = cmd.tensors(self.device)
            self.model(ids, pos, attn, self.cache, capture_layers=cmd.capture_layers)
        elif isinstance(cmd, Logits):
            hidden = torch.empty(cmd.rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
            dist.broadcast(hidden, src=0)
            self.model.compute_logits(hidden)
        elif isinstance(cmd, CopySlots):
            self.cache.copy_slots(torch.tensor(cmd.src, dtype=torch.int64), torch.tensor(cmd.dst, dtype=torch.int64))
        else:
            raise TypeError(f"unknown command {type(cmd).__name__}")


def serve(rdv: rv.Rendezvous, device_index: int | None = None, checkpoint: str | None = None) -> int:
    """Join rank 0, load the shard, follow commands. Returns the exit code."""
    rv.disable_multicast()
    store = rv.open_store(rdv, STORE_TIMEOUT)
    rv.announce(store, rdv.rank)
    spec = rv.read_spec(store)  # the spec names the device type, which picks the backend: it comes first
    if checkpoint is not None:
        spec = ShardSpec(**{**spec.__dict__, "checkpoint": checkpoint})
    index = rdv.local_rank if device_index is None else device_index
    device = rv.rank_device(spec.device_type, index) if spec.device_type == "cuda" else torch.device("cpu")
    control = rv.init_groups(store, rdv, device)
    channel = Channel(control)
    shard, error = None, None
    try:
        shard = _Shard(spec, rdv.rank, device)
    except Exception as e:  # reported to rank 0, which raises it for the caller
        error = f"rank {rdv.rank}: {type(e).__name__}: {e}"
    if any(channel.gather_status(error)) or shard is None:
        rv.destroy_groups()
        return 1
    while True:
        cmd = channel.recv()
        if isinstance(cmd, Stop):
            break
        try:
            shard.run(cmd)
        except ValueError:
            # input refused by a check every rank runs identically before any collective: rank 0 raised
            # the same error to its caller, so the ranks are still in step
            continue
    rv.destroy_groups()
    return 0


def _exit_with_parent() -> None:
    """A spawned worker ends when the process that spawned it (rank 0) ends, however it ended."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def spawned_worker(rdv: rv.Rendezvous, device_index: int | None, threads: int) -> None:
    """Entry point of a worker that rank 0 started on its own host (multiprocessing forkserver)."""
    import multiprocessing.connection  # noqa: F401  (used by the watchdog)

    _exit_with_parent()
    torch.set_num_threads(threads)
    try:
        code = serve(rdv, device_index)
    except Exception:
        traceback.print_exc()
        code = 1
    if code:
        sys.exit(code)  # multiprocessing turns it into the exit code (and still runs its finalizers)
