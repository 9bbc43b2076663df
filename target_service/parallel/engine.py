"""ParallelTargetEngine: the TargetEngine API over a model sharded on N ranks (tensor / expert parallel).

This process is rank 0. It runs the unchanged TargetEngine logic (sessions, block manager, sampling,
acceptance) around its own shard; the model and cache it drives are thin wrappers that first send each
operation (forward, logits, slot copy) to ranks 1..N-1, which then run the same operation on their
shards, meeting rank 0 in the model's all-reduces. Services and `generate` use it like a TargetEngine.

One parallel engine per process at a time (it owns torch.distributed's default group). The ranks are
started through multiprocessing (forkserver), so a script that builds one must guard its entry point
with ``if __name__ == "__main__":``, as multiprocessing requires.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.backends import select_backends
from specserve.models.causal_lm import build_model
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.dtypes import DTYPES, ENGINE_DTYPES
from specserve.models.loader import load_tokenizer
from specserve.target_service.engine.engine import TargetEngine
from specserve.target_service.parallel.group import RankGroup
from specserve.target_service.parallel.protocol import (
    CopySlots,
    Forward,
    Logits,
    ShardSpec,
)
from specserve.target_service.parallel.rendezvous import ParallelError
from specserve.target_service.parallel.worker import load_shard


class _Driver:
    """Sends commands to the other ranks; once a collective fails the group is unusable."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.broken: str | None = None

    def run(self, command: object, local, *args):
        """Send `command`, then run `local(*args)` here (the same operation on rank 0's shard)."""
        if self.broken is not None:
            raise ParallelError(f"the parallel target lost a rank earlier ({self.broken}); restart it")
        if self.group.channel is None:
            raise ParallelError("the parallel target is closed")
        try:
            self.group.channel.send(command)
            return local(*args)
        except ValueError:
            raise  # refused input: every rank refused it the same way, still in step
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise


class DrivenModel:
    """Rank 0's CausalLM shard; forward and compute_logits run on every rank."""

    def __init__(self, model, driver: _Driver) -> None:
        self._model = model
        self._driver = driver

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        attn: AttentionBatch,
        kv_cache,
        capture_layers: tuple[int, ...] = (),
    ):
        self._model._check_inputs(input_ids, positions, attn, kv_cache, capture_layers)  # refuse before sending
        command = Forward.of(input_ids, positions, attn, capture_layers)
        return self._driver.run(command, self._model, input_ids, positions, attn, kv_cache, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        hidden = hidden.contiguous()

        def local() -> torch.Tensor:
            dist.broadcast(hidden, src=0)  # the workers score exactly rank 0's rows
            return self._model.compute_logits(hidden)

        return self._driver.run(Logits(rows=hidden.shape[0]), local)


class DrivenCache:
    """Rank 0's PagedKVCache shard; slot copies (accepted tree paths) happen on every rank."""

    def __init__(self, cache, driver: _Driver) -> None:
        self._cache = cache
        self._driver = driver

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:  # [n], [n] int64
        command = CopySlots(tuple(src.reshape(-1).tolist()), tuple(dst.reshape(-1).tolist()))
        self._driver.run(command, self._cache.copy_slots, src, dst)


def check_split(config: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse a model that does not split over the ranks, before any process starts (the layer
    constructors decide, built on the meta device)."""
    try:
        with torch.device("meta"):
            build_model(config, parallel)
    except ValueError as e:
        mode = "expert" if parallel.ep else "tensor"
        raise ParallelError(
            f"{config.model_type} does not split over {parallel.tp_size} ranks ({mode} parallel): {e}"
        ) from None


class ParallelTargetEngine(TargetEngine):
    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *,
        tensor_parallel_size: int,
        expert_parallel: bool = False,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        num_blocks: int,
        block_size: int = 16,
        progress: bool = True,
        attention_backend: str = "auto",  # models/backends.py: auto | torch | flashinfer | reference
        moe_backend: str = "auto",  # auto | torch | fused
        **engine_kwargs,  # hidden_layers, max_context, vocab_hash
    ) -> None:
        if tensor_parallel_size < 1:  # 1 = the same machinery without workers (a process group of one)
            raise ParallelError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if dtype not in ENGINE_DTYPES:
            raise ParallelError(f"dtype must be one of {sorted(ENGINE_DTYPES)}, got {dtype!r}")
        if engine_kwargs.get("cuda_graphs"):
            raise ParallelError("CUDA graphs are not supported with tensor parallelism (the ranks run eagerly)")
        checkpoint = os.fspath(checkpoint)
        if not os.path.isdir(checkpoint):
            raise ParallelError(
                f"a parallel target needs a checkpoint folder (each rank reads its shards), got {checkpoint}"
            )
        config = ModelConfig.from_file(checkpoint)
        check_split(config, ParallelConfig(0, tensor_parallel_size, expert_parallel))
        choice = select_backends(config, torch.device(device), DTYPES[dtype], attention_backend, moe_backend)
        spec = ShardSpec(
            os.path.abspath(checkpoint),
            dtype,
            torch.device(device).type,
            tensor_parallel_size,
            expert_parallel,
            num_blocks,
            block_size,
            choice.attention,
            choice.moe,
        )
        self.parallel_spec = spec
        self._group = RankGroup(spec, device)
        try:
            model, error = None, None
            try:
                model, config = load_shard(spec, 0, self._group.device, progress)
            except Exception as e:  # every rank reports; the startup error names them all
                error = f"rank 0: {type(e).__name__}: {e}"
            self._group.check_ready(error)
            self._driver = _Driver(self._group)
            super().__init__(
                DrivenModel(model, self._driver),
                config,
                load_tokenizer(checkpoint),
                num_blocks=num_blocks,
                block_size=block_size,
                device=self._group.device,
                **engine_kwargs,
            )
            self.kv_cache = DrivenCache(self.kv_cache, self._driver)
        except BaseException:
            self._group.close()
            raise
        # stop the ranks on close(), when the engine is garbage-collected, or at interpreter exit
        self._finalizer = weakref.finalize(self, RankGroup.close, self._group)

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallel_spec.tp_size

    def close(self) -> None:
        """Stop the other ranks and leave the process groups (idempotent; also runs when the engine is
        collected and at exit)."""
        self._finalizer()

    def __enter__(self) -> ParallelTargetEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
