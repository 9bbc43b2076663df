"""Build a TargetEngine from a checkpoint folder (or a synthetic preset): the one place `generate`, `serve`, the
target service and the step benchmark turn flags into a running engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.errors import SpecserveError
from specserve.models.dtypes import DTYPES, ENGINE_DTYPES

# invariant steps on the CPU: rows a multiple of this, so no row falls in the scalar tail of a vectorised elementwise
# kernel (torch CPU kernels compute exp / sigmoid / silu there with other code, so the tail rows round differently)
CPU_ROWS = 64
INVARIANT_STEPS = {"auto": None, "on": True, "off": False}  # --invariant-steps -> EngineConfig.invariant_steps
GRAPH_ATTENTION = ("flashinfer", "triton_paged", "paged_torch")  # attention backends that read no lengths on the host


@dataclass(frozen=True)
class EngineConfig:
    # checkpoint folder, "synthetic:NAME[:LAYERS]" (models/presets.py: random weights), or "demo@NAME[:LAYERS]" (the
    # shipped demo embedded in a published model's shape: models/scaled_demo.py)
    model: Path | str
    device: str = "cpu"
    dtype: str = "float32"
    num_kv_blocks: int = 4096
    kv_block_size: int = 16
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    attention_backend: str = (
        "auto"  # auto | torch | flashinfer | triton_paged | paged_torch | reference (models/backends.py picks for auto)
    )
    moe_backend: str = "auto"  # auto | torch | fused
    fused_layers: bool | None = None  # None: on with the fused MoE (models/backends.select_backends)
    skinny_gemm: bool = False  # the fused layers' projections through kernels/skinny_gemm.py (default cuBLAS: faster)
    fused_moe_block: bool = True  # the fused layers' MoE block: gate GEMM in the router kernel, shared experts routed
    fold_epilogues: bool = True  # the fused layers' MoE top-k sum in the next norm, MLA's W_UV in its split merge
    cuda_graphs: bool | None = None  # None: on when the chosen attention backend is graph-safe (GRAPH_ATTENTION)
    graph_max_draft: int = 16  # graphs for decode and chain verify of 1..graph_max_draft drafted tokens
    graph_tree_sizes: tuple[int, ...] = ()  # graphs for tree verify steps of these node counts
    max_context: int | None = None  # cap below the model's max_position_embeddings
    # token-count invariant steps (greedy speculation gives target-only's output bit for bit, in bf16 too): every
    # single-session step of up to graph_max_draft + 1 tokens (or the largest tree size) runs padded to that many
    # rows on backends whose reductions do not depend on the step (models/backends.py). None: on a GPU where the
    # attention asked for allows it (auto does), off on the CPU (64 rows a step there: CPU_ROWS); True: required
    # (the CPU too); False: off
    invariant_steps: bool | None = None
    seed: int = 0  # synthetic weights
    seed_key: bytes | None = field(default=None, repr=False)  # seeded sampling's secret (models/probs.py); None: random
    # Benchmark only (`specserve bench step --shard R/N`): build rank R of an N-way tensor-parallel shard of a
    # synthetic preset or a demo@ model (routed experts expert-parallel when enable_expert_parallel; a demo@ shard
    # needs it) in this one process, without torch.distributed; its collectives are skipped
    # (ParallelConfig.collectives=False), so its outputs are not the model's.
    bench_shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        from specserve.models.errors import ModelConfigError
        from specserve.models.model_names import resolve_model
        from specserve.models.presets import is_synthetic
        from specserve.models.scaled_shapes import is_scaled_demo

        if self.dtype not in ENGINE_DTYPES:
            raise SpecserveError(f"--dtype must be one of {sorted(ENGINE_DTYPES)}, got {self.dtype!r}")
        try:
            resolve_model(self.model)  # a folder, or a demo@ / synthetic name it knows
        except ModelConfigError as e:
            raise SpecserveError(str(e)) from e
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecserveError("--device cuda was asked for but no CUDA GPU is visible")
        if self.graph_max_draft < 0 or any(n < 1 for n in self.graph_tree_sizes):
            raise SpecserveError(
                f"graph sizes must be positive, got max draft {self.graph_max_draft}, trees {self.graph_tree_sizes}"
            )
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise SpecserveError("--cuda-graphs needs --device cuda")
        if self.invariant_steps and (self.tensor_parallel_size > 1 or self.bench_shard is not None):
            raise SpecserveError("--invariant-steps runs on one device (not with --tensor-parallel-size or --shard)")
        if self.bench_shard is not None:
            rank, size = self.bench_shard
            if not 0 <= rank < size or size < 2:
                raise SpecserveError(f"--shard R/N needs N >= 2 and 0 <= R < N, got {rank}/{size}")
            if not (is_synthetic(self.model) or is_scaled_demo(self.model)) or self.tensor_parallel_size != 1:
                raise SpecserveError(
                    "--shard is for synthetic presets and demo@ models in one process (benchmarks "
                    f"only), not with {self.model} at --tensor-parallel-size "
                    f"{self.tensor_parallel_size}"
                )
            if is_scaled_demo(self.model) and not self.enable_expert_parallel:
                raise SpecserveError(
                    "--shard of a demo@ model splits its routed experts whole: it needs expert parallelism"
                )


def build_model_for(cfg: EngineConfig):
    """(model, ModelConfig, tokenizer or None) with the chosen MoE / attention backends installed."""
    from specserve.models.backends import install_backends, select_backends
    from specserve.models.loader import load_model, load_tokenizer
    from specserve.models.presets import build_synthetic_model, is_synthetic
    from specserve.models.scaled_demo import build_scaled_demo
    from specserve.models.scaled_shapes import is_scaled_demo

    dtype = DTYPES[cfg.dtype]
    parallel = None
    if cfg.bench_shard is not None:  # one rank's shard alone: collectives off (benchmarks only)
        from specserve.models.config import ParallelConfig

        parallel = ParallelConfig(
            tp_rank=cfg.bench_shard[0], tp_size=cfg.bench_shard[1], ep=cfg.enable_expert_parallel, collectives=False
        )
    if is_scaled_demo(cfg.model):
        from specserve.models.model_names import resolve_model

        demo = resolve_model(cfg.model)
        model, model_config = build_scaled_demo(
            str(cfg.model), demo.folder, device=cfg.device, dtype=dtype, seed=cfg.seed, parallel=parallel
        )
        tokenizer = load_tokenizer(demo.tokenizer_folder)
    elif is_synthetic(cfg.model):
        model, model_config = build_synthetic_model(
            str(cfg.model), device=cfg.device, dtype=dtype, parallel=parallel, seed=cfg.seed
        )
        tokenizer = None
    else:
        model, model_config = load_model(cfg.model, device=cfg.device, dtype=dtype)
        tokenizer = load_tokenizer(cfg.model)
    invariant = cfg.invariant_steps if cfg.tensor_parallel_size == 1 and cfg.bench_shard is None else False
    choice = select_backends(
        model_config,
        cfg.device,
        dtype,
        cfg.attention_backend,
        cfg.moe_backend,
        cfg.fused_layers,
        invariant,
        cfg.skinny_gemm,
        cfg.fused_moe_block,
        cfg.fold_epilogues,
    )
    install_backends(model, choice, cfg.kv_block_size, cfg.device, dtype)
    return model, model_config, tokenizer, choice


def build_engine(cfg: EngineConfig):
    """Load the checkpoint (or build the synthetic model) and wrap it in a TargetEngine with its paged KV cache."""
    from specserve.target_service.engine.engine import TargetEngine
    from specserve.target_service.engine.model_runner import GraphOptions

    if cfg.tensor_parallel_size > 1:  # one process per rank; this one is rank 0 (same engine API)
        from specserve.target_service.parallel.engine import ParallelTargetEngine

        return ParallelTargetEngine(
            cfg.model,
            tensor_parallel_size=cfg.tensor_parallel_size,
            expert_parallel=cfg.enable_expert_parallel,
            device=cfg.device,
            dtype=cfg.dtype,
            num_blocks=cfg.num_kv_blocks,
            block_size=cfg.kv_block_size,
            max_context=cfg.max_context,
            attention_backend=cfg.attention_backend,
            moe_backend=cfg.moe_backend,
            seed_key=cfg.seed_key,
        )

    model, model_config, tokenizer, choice = build_model_for(cfg)
    graphs = cfg.cuda_graphs
    if graphs is None:  # on where every step is capturable: graph-safe attention and (if any) the fused MoE
        graphs = (
            cfg.device.startswith("cuda")
            and choice.attention in GRAPH_ATTENTION
            and (model_config.moe is None or choice.moe == "fused")
        )
    options = None
    if graphs:
        options = GraphOptions(chain_sizes=tuple(range(1, cfg.graph_max_draft + 2)), tree_sizes=cfg.graph_tree_sizes)
    return TargetEngine(
        model,
        model_config,
        tokenizer,
        num_blocks=cfg.num_kv_blocks,
        block_size=cfg.kv_block_size,
        device=cfg.device,
        max_context=cfg.max_context,
        cuda_graphs=options,
        seed_key=cfg.seed_key,
        invariant_rows=invariant_rows(cfg) if choice.invariant else 0,
    )


def invariant_rows(cfg: EngineConfig) -> int:
    """The row count invariant steps are padded to: the largest graphed step (a chain of graph_max_draft drafted
    tokens, or the largest tree)."""
    rows = max((cfg.graph_max_draft + 1, *cfg.graph_tree_sizes))
    return rows if cfg.device.startswith("cuda") else -(-rows // CPU_ROWS) * CPU_ROWS


def invariant_flag(value: bool | None) -> str:
    """The --invariant-steps word of an EngineConfig.invariant_steps value."""
    return {v: k for k, v in INVARIANT_STEPS.items()}[value]
