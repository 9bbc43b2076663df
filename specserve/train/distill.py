"""What drafters learn from: the trained target's greedy continuations, soft next-token distributions and
hidden features (transformers' DeepseekV3ForCausalLM, frozen).

Feature convention = the engine's capture convention: the output of decoder layer i (before the final
norm), read with forward hooks on ``model.model.layers[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.train.common import TrainError, autocast


def load_target(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        raise TrainError(f"no target checkpoint (config.json) at {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.to(device).eval().requires_grad_(False)
    return model


@torch.no_grad()
def greedy_continue(
    model, prompts: torch.Tensor, new_tokens: int, batch_size: int, device: torch.device
) -> torch.Tensor:
    """prompts [N, P] int64 -> [N, P + new_tokens] greedy continuations (EOS does not stop)."""
    outs = []
    for i in range(0, len(prompts), batch_size):
        ids = prompts[i : i + batch_size].to(device)
        with autocast(device):
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(out[:, : ids.shape[1] + new_tokens].cpu())
    return torch.cat(outs)


@torch.no_grad()
def target_outputs(model, ids: torch.Tensor, layers: tuple[int, ...] = ()):
    """ids [B, T] -> (logits [B, T, V] float32, features [B, T, len(layers) * H] or None)."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for i in layers:

        def hook(module, inputs, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output

        handles.append(model.model.layers[i].register_forward_hook(hook))
    try:
        with autocast(ids.device):
            logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        for h in handles:
            h.remove()
    feats = torch.cat([captured[i].float() for i in layers], dim=-1) if layers else None
    return logits, feats


@dataclass(frozen=True)
class SelfDistillSpec:
    num_prompts: int = 2048
    prompt_len: int = 64
    new_tokens: int = 128
    batch_size: int = 256
    seed: int = 1

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.prompt_len, self.new_tokens, self.batch_size) < 1:
            raise TrainError("self-distillation sizes must be >= 1")


def self_distill_sequences(
    model, train_stream: np.ndarray, spec: SelfDistillSpec, device: torch.device, cache: Path | None = None
) -> torch.Tensor:
    """[N, prompt_len + new_tokens]: random training-text prompts continued greedily by the target
    (the distribution the drafters meet at temperature 0). ``cache``: a .pt file reused when it was
    made with the same spec (several drafters trained in one session share it; stored as int16 when the
    vocabulary fits, a quarter of the size, so a cache can travel with a GPU call)."""
    if cache is not None and Path(cache).is_file():
        saved = torch.load(cache)
        if saved.get("spec") == repr(spec):
            return saved["sequences"].long()
    seqs = _self_distill(model, train_stream, spec, device)
    if cache is not None:
        small = torch.int16 if model.config.vocab_size <= torch.iinfo(torch.int16).max + 1 else torch.int32
        torch.save({"spec": repr(spec), "sequences": seqs.to(small)}, cache)
    return seqs


def _self_distill(model, train_stream: np.ndarray, spec: SelfDistillSpec, device: torch.device) -> torch.Tensor:
    if len(train_stream) < spec.prompt_len + 1:
        raise TrainError("training stream shorter than one prompt")
    rng = np.random.default_rng(spec.seed)
    starts = rng.integers(0, len(train_stream) - spec.prompt_len, size=spec.num_prompts)
    prompts = np.stack([train_stream[s : s + spec.prompt_len] for s in starts]).astype(np.int64)
    return greedy_continue(model, torch.from_numpy(prompts), spec.new_tokens, spec.batch_size, device)


class MixedBatches:
    """Batches of length-T sequences: a ``selfdistill_frac`` share from the self-distilled set, the rest
    random corpus windows of the same length."""

    def __init__(
        self, seqs: torch.Tensor, train_stream: np.ndarray, batch_size: int, selfdistill_frac: float, seed: int
    ) -> None:
        if not 0.0 <= selfdistill_frac <= 1.0:
            raise TrainError(f"selfdistill_frac must be in [0, 1], got {selfdistill_frac}")
        self.seqs = seqs  # [N, T]
        self.stream = torch.from_numpy(train_stream.astype(np.int64))
        self.T = seqs.shape[1]
        if len(self.stream) < self.T + 1:
            raise TrainError("training stream shorter than one sequence")
        self.batch_size = batch_size
        self.n_self = int(round(batch_size * selfdistill_frac))
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:  # [B, T]
        parts = []
        if self.n_self:
            parts.append(self.seqs[torch.from_numpy(self.rng.integers(0, len(self.seqs), self.n_self))])
        n_corpus = self.batch_size - self.n_self
        if n_corpus:
            starts = torch.from_numpy(self.rng.integers(0, len(self.stream) - self.T, n_corpus))
            parts.append(self.stream[starts[:, None] + torch.arange(self.T)[None, :]])
        return torch.cat(parts)
