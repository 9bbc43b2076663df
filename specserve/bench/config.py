"""The benchmark's configuration and its plan: which methods run, which are skipped and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from specserve.contract.speculation import block_size_for
from specserve.errors import SpecserveError

DRAFTERS = ("none", "ngram", "model", "eagle3", "dflash", "dspark", "mtp")  # the order methods run in
CHECKPOINT_FREE = frozenset(
    {"none", "ngram", "mtp"}
)  # drafters that need no checkpoint of their own (mtp: the target's layer)
SPECULATION_MODES = ("fixed", "adaptive")


class BenchConfigError(SpecserveError):
    """Benchmark flags that cannot describe a run."""


@dataclass(frozen=True)
class BenchConfig:
    model: Path  # checkpoint folder, or a model name the engine builds ("demo@NAME[:LAYERS]": models/scaled_demo.py)
    out: Path
    draft_models: Mapping[str, Path] = field(default_factory=dict)  # family -> checkpoint folder
    demo_drafters: bool = False  # families not in draft_models come from the shipped demo (demo target)
    drafters: tuple[str, ...] = DRAFTERS
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 128
    num_speculative_tokens: int = 4
    fixed_ks: tuple[int, ...] = ()  # k of each fixed-k method; () = just num_speculative_tokens
    prompt_set: str = "v1"
    num_prompts: int | None = None  # None = the whole set
    speculation: tuple[str, ...] = ("fixed",)
    draft_ahead: tuple[bool, ...] = (False,)
    k_sweep: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16)
    tax_context: int = 256  # cached tokens before the verify-tax steps
    tax_repeats: int = 10
    seed: int = 0
    warmup: int = 1  # unrecorded warm-up requests per method
    hf_baselines: bool = True
    bandwidth_bytes: int | None = None  # size of the bandwidth copy; None: 1 GiB on GPU, 256 MiB on CPU
    num_kv_blocks: int = 4096
    kv_block_size: int = 16
    invariant_steps: bool | None = None  # the target's token-count invariant steps (EngineConfig.invariant_steps)
    projection_timings: Path | None = None  # GPU synthetic-model timings (see specserve.bench.projection)
    projection_model: str | None = None  # which model of a step_bench.json (default: the Qwen3-30B-A3B preset)
    projection_context: int | None = None  # which context of a step_bench.json (default: its smallest)
    plots: bool = True
    # where each method runs: "process" (in this process), "serve-shm" / "serve-grpc" (service processes,
    # shared-memory data plane or gRPC only: specserve/bench/served.py)
    via: tuple[str, ...] = ("process",)

    def __post_init__(self) -> None:
        object.__setattr__(self, "draft_models", MappingProxyType({k: Path(v) for k, v in self.draft_models.items()}))
        unknown = [d for d in (*self.drafters, *self.draft_models) if d not in DRAFTERS]
        if unknown:
            raise BenchConfigError(f"unknown drafter(s) {unknown}; known: {', '.join(DRAFTERS)}")
        bad_vias = [v for v in self.via if v not in ("process", "serve-shm", "serve-grpc")]
        if bad_vias or not self.via:
            raise BenchConfigError(f"via must be among process, serve-shm, serve-grpc, got {self.via}")
        if not self.drafters:
            raise BenchConfigError("at least one drafter (or 'none') must be benchmarked")
        bad_modes = [m for m in self.speculation if m not in SPECULATION_MODES]
        if bad_modes or not self.speculation:
            raise BenchConfigError(f"speculation modes must be among {SPECULATION_MODES}, got {self.speculation}")
        if not self.draft_ahead:
            raise BenchConfigError("draft_ahead needs at least one setting")
        for name in (
            "max_new_tokens",
            "num_speculative_tokens",
            "tax_context",
            "tax_repeats",
            "num_kv_blocks",
            "kv_block_size",
        ):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.fixed_ks, (tuple, list)) or any(
            isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in self.fixed_ks
        ):
            raise BenchConfigError(f"fixed_ks must be positive integers (drafted tokens per step), got {self.fixed_ks}")
        object.__setattr__(self, "fixed_ks", tuple(sorted(set(self.fixed_ks))) or (self.num_speculative_tokens,))
        if self.warmup < 0:
            raise BenchConfigError(f"warmup must be >= 0, got {self.warmup}")
        if not self.k_sweep or min(self.k_sweep) < 0:
            raise BenchConfigError(f"k_sweep needs non-negative block sizes, got {self.k_sweep}")
        object.__setattr__(self, "k_sweep", tuple(sorted(set(self.k_sweep))))
        if self.bandwidth_bytes is not None and self.bandwidth_bytes < 1 << 20:
            raise BenchConfigError("bandwidth_bytes must be at least 1 MiB")
        if self.dtype not in ("float32", "bfloat16"):
            raise BenchConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.is_cuda:
            import torch

            if not torch.cuda.is_available():
                raise BenchConfigError("--device cuda was asked for but no CUDA GPU is visible")
        elif self.device != "cpu":
            raise BenchConfigError(f"device must be cpu or cuda[:N], got {self.device!r}")
        from specserve.models.errors import ModelConfigError
        from specserve.models.scaled_shapes import is_scaled_demo, parse_scaled_spec

        if is_scaled_demo(self.model):
            try:
                parse_scaled_spec(str(self.model))
            except ModelConfigError as exc:
                raise BenchConfigError(str(exc)) from None
        elif not Path(self.model).is_dir():
            raise BenchConfigError(f"model folder {self.model} does not exist")

    @property
    def model_folder(self) -> Path:
        """The checkpoint folder behind the model: its tokenizer, and the target files drafters read (a demo@ model:
        the shipped demo target's)."""
        from specserve.models.scaled_shapes import is_scaled_demo
        from specserve.paths import demo_checkpoint

        return demo_checkpoint("target") if is_scaled_demo(self.model) else Path(self.model)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def copy_bytes(self) -> int:
        if self.bandwidth_bytes is not None:
            return self.bandwidth_bytes
        return (1 << 30) if self.is_cuda else (256 << 20)

    @property
    def max_k(self) -> int:
        """The largest k of the run: the adaptive methods' cap, and what the drafters must serve."""
        return max(*self.fixed_ks, self.num_speculative_tokens)

    @property
    def drafter_block_size(self) -> int:
        """What the drafters are built for: chains of max_k (draft-ahead asks for one more: contract/speculation)."""
        return block_size_for(self.max_k)


@dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration of our stack (the HF baselines are separate)."""

    drafter: str  # a DRAFTERS entry
    adaptive: bool = False
    draft_ahead: bool = False
    k: int = 0  # drafted tokens per step (fixed), the cap (adaptive); 0 for target-only

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise BenchConfigError(f"unknown drafter {self.drafter!r}; known: {', '.join(DRAFTERS)}")
        if (self.k == 0) != (self.drafter == "none") or self.k < 0:
            raise BenchConfigError(
                f"a method drafts k >= 1 tokens (k = 0 only for target-only), got "
                f"drafter {self.drafter!r} with k = {self.k}"
            )

    @property
    def name(self) -> str:
        """target-only, DRAFTER/fixed/kK[/ahead], DRAFTER/adaptive[/ahead] (its cap is in the summary)."""
        if self.drafter == "none":
            return "target-only"
        parts = [self.drafter, "adaptive"] if self.adaptive else [self.drafter, "fixed", f"k{self.k}"]
        if self.draft_ahead:
            parts.append("ahead")
        return "/".join(parts)

    @property
    def speculation(self) -> str:
        return "adaptive" if self.adaptive else "fixed"


@dataclass(frozen=True)
class Skipped:
    method: str
    reason: str

    def as_dict(self) -> dict:
        return {"method": self.method, "reason": self.reason}


def plan_methods(
    config: BenchConfig, ready: Mapping[str, bool], needs_hidden: Mapping[str, bool]
) -> tuple[list[MethodSpec], list[Skipped]]:
    """The methods to run, given which drafters were built (``ready``) and which read target hidden
    states (draft-ahead does not apply to those: the loop never drafts ahead for them)."""
    methods, skipped = [], []
    for drafter in config.drafters:
        if drafter == "none":
            methods.append(MethodSpec("none", k=0))
            continue
        if not ready.get(drafter, False):
            continue  # the builder already recorded why
        for mode in config.speculation:
            ks = (config.max_k,) if mode == "adaptive" else config.fixed_ks
            for k in ks:
                for ahead in config.draft_ahead:
                    spec = MethodSpec(drafter, adaptive=mode == "adaptive", draft_ahead=ahead, k=k)
                    if ahead and needs_hidden.get(drafter, False):
                        skipped.append(
                            Skipped(spec.name, "draft-ahead does not apply to drafters that read target hidden states")
                        )
                        continue
                    methods.append(spec)
    return methods, skipped
