"""Pieces every training loop shares: seeding, devices, the step/time-bounded LR schedule, logging,
bfloat16 safetensors export and checkpoint size accounting."""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.errors import SpecserveError


class TrainError(SpecserveError):
    """Bad training settings (steps, device, paths)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise TrainError(f"device must be cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise TrainError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def autocast(device: torch.device):
    """bfloat16 autocast on CUDA (fp32 master weights); plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Schedule:
    """Linear warmup then cosine decay to ``min_ratio * lr``. Progress is the larger of step/steps and
    elapsed/time_limit_s, so a run always finishes its decay inside its time limit; when the step count
    binds first the run is exactly reproducible."""

    lr: float
    steps: int
    warmup: int = 50
    min_ratio: float = 0.1
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise TrainError(f"steps must be >= 1, got {self.steps}")
        if not self.lr > 0:
            raise TrainError(f"lr must be > 0, got {self.lr}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise TrainError(f"time limit must be > 0 s, got {self.time_limit_s}")

    def progress(self, step: int, elapsed_s: float) -> float:
        p = step / self.steps
        if self.time_limit_s is not None:
            p = max(p, elapsed_s / self.time_limit_s)
        return p

    def lr_at(self, step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / max(1, min(self.warmup, self.steps)))
        cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * warm * (self.min_ratio + (1.0 - self.min_ratio) * cos)

    def set_lr(self, opt: torch.optim.Optimizer, step: int, elapsed_s: float) -> float | None:
        """Set this step's learning rate on every group of ``opt``; None once the run is over."""
        progress = self.progress(step, elapsed_s)
        if progress >= 1.0:
            return None
        lr = self.lr_at(step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        return lr


def make_optimizer(params, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


class Logger:
    """Prints to stdout and appends JSON lines to ``log_path`` (when given). Lines go through tqdm.write,
    so a progress bar on the same terminal is redrawn below them instead of being cut."""

    def __init__(self, log_path: Path | None = None) -> None:
        self.log_path = log_path
        self.t0 = time.monotonic()

    def __call__(self, event: str, **fields) -> None:
        from tqdm import tqdm

        fields = {"event": event, "t": round(time.monotonic() - self.t0, 2), **fields}
        tqdm.write(" ".join(f"{k}={_fmt(v)}" for k, v in fields.items()), file=sys.stdout)
        sys.stdout.flush()
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(fields) + "\n")


class Progress:
    """A training loop's progress bar on stderr: steps, loss, tokens/s and ETA (the sooner of the steps
    left at the current pace and the time limit). No bar when stderr is not a terminal (a log file)."""

    def __init__(self, desc: str, steps: int, tokens_per_step: int, time_limit_s: float | None = None) -> None:
        from tqdm import tqdm

        self.steps, self.tokens_per_step, self.time_limit_s = steps, tokens_per_step, time_limit_s
        self.t0, self.loss = time.monotonic(), float("nan")
        self.bar = tqdm(
            total=steps,
            desc=desc,
            unit="step",
            file=sys.stderr,
            disable=None,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
        )

    def step(self, step: int, loss: float | None = None) -> None:
        """Step ``step`` is done; ``loss`` when the loop has read one (a read is a host sync on a GPU)."""
        if self.bar.disable:
            return
        if loss is not None:
            self.loss = loss
        elapsed = time.monotonic() - self.t0
        eta = (self.steps - step) * elapsed / max(step, 1)
        if self.time_limit_s is not None:
            eta = min(eta, max(0.0, self.time_limit_s - elapsed))
        self.bar.set_postfix_str(
            f"loss {self.loss:.3f}, {step * self.tokens_per_step / elapsed:,.0f} tok/s, "
            f"eta {int(eta) // 60}:{int(eta) % 60:02d}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def folder_size_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def write_json(path: Path, obj) -> None:
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj)
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def run_info(args_namespace) -> dict:
    """What a checkpoint's train_info.json records about the command that made it."""
    return {
        "python": "%d.%d.%d" % sys.version_info[:3],
        "torch": torch.__version__,
        "argv": sys.argv,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args_namespace).items() if k != "func"},
    }


def parse_arch(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings -> {key: value string}."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TrainError(f"bad --arch {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def apply_arch(spec, overrides: dict[str, str]):
    """A copy of the frozen spec dataclass with fields replaced, each value cast to the field's type."""
    from dataclasses import fields, replace

    known = {f.name for f in fields(spec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TrainError(f"unknown --arch key(s) {unknown} for {type(spec).__name__}; known: {sorted(known)}")
    cast = {}
    for key, value in overrides.items():
        current = getattr(spec, key)
        try:
            cast[key] = type(current)(float(value)) if isinstance(current, float) else int(value)
        except ValueError:
            raise TrainError(f"--arch {key}={value}: expected a number") from None
    return replace(spec, **cast)
