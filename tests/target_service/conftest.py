"""Shared fixtures for target-service tests: tiny random Hugging Face checkpoints and a paged-cache runner.

Fixture API (session-scoped, reusable by any test under tests/target_service/):

    tiny_checkpoint(name: str, *, max_shard_size: str | None = None) -> pathlib.Path
        Directory holding config.json + safetensors written by transformers' save_pretrained (float32,
        seed 0, sizes ~hidden 64 / 2-3 layers / vocab 256, eos_token_id None so generation never stops
        early). Built once per (name, max_shard_size). `name` is one of TINY_ARCHS:
          deepseek_v3        MLA q_lora_rank=24, YaRN (mscale != mscale_all_dim), first_k_dense_replace=1,
                             n_group=4/topk_group=2, random e_score_correction_bias, 3 layers
          deepseek_v3_plain  MLA q_lora_rank=None, default rope, rope_interleave=False, n_group=1,
                             norm_topk_prob=False, 2 layers
          kimi_k2            the deepseek_v3 weights with model_type "kimi_k2" and the legacy
                             rope_scaling/rope_theta config keys (transformers cannot load it; compare
                             against tiny_checkpoint("deepseek_v3"))
          qwen3_moe          per-head q/k norm, softmax router, norm_topk_prob, mlp_only_layers=[1], 3 layers
          mixtral            softmax router, sliding_window=8, 4 experts
          llama              tied embeddings, llama3 rope scaling
          qwen3              dense, q/k norm, head_dim 32 != hidden/heads
    tiny_arch_names -> tuple[str, ...]       the names above
    hf_reference_dir(name) -> pathlib.Path    checkpoint transformers can load for that name (kimi_k2 ->
                                              deepseek_v3; the others -> tiny_checkpoint(name))
    paged_runner(model, block_size=4, num_blocks=256) -> PagedRunner   see PagedRunner below
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from tiny_hf import TINY_BASE, TINY_QWEN3_MOE, save_tiny_hf

from specserve.models.attn_metadata import AttentionBatch
from specserve.models.kv_cache import PagedKVCache

_DEEPSEEK = dict(
    TINY_BASE,
    num_key_value_heads=4,  # transformers' MLA needs kv heads == heads
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)

TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            _DEEPSEEK,
            num_hidden_layers=3,
            q_lora_rank=24,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=0.8,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
    "deepseek_v3_plain": (
        "deepseek_v3",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            rope_interleave=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(TINY_BASE, **TINY_QWEN3_MOE, num_hidden_layers=3, mlp_only_layers=[1]),
    ),
    "mixtral": (
        "mixtral",
        dict(TINY_BASE, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    ),
    "llama": (
        "llama",
        dict(
            TINY_BASE,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen3": ("qwen3", dict(TINY_BASE, head_dim=32)),
}
DERIVED = {"kimi_k2": "deepseek_v3"}
ALL_NAMES = (*TINY_ARCHS, *DERIVED)


def _save_hf(model_type: str, kwargs: dict, out: Path, max_shard_size: str | None) -> None:
    save_tiny_hf(model_type, kwargs, out, max_shard_size=max_shard_size)


def _to_kimi(src: Path, out: Path) -> None:
    """kimi_k2 = DeepSeek-V3 weights + model_type kimi_k2 + legacy rope_scaling / rope_theta keys."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    cfg["rope_scaling"] = rope
    cfg["model_type"] = "kimi_k2"
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="session")
def tiny_arch_names() -> tuple[str, ...]:
    return ALL_NAMES


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    built: dict[tuple[str, str | None], Path] = {}

    def make(name: str, *, max_shard_size: str | None = None) -> Path:
        if name not in ALL_NAMES:
            raise KeyError(f"unknown tiny checkpoint {name!r}; choose from {ALL_NAMES}")
        key = (name, max_shard_size)
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt_{name}") / "model"
            if name in DERIVED:
                _to_kimi(make(DERIVED[name], max_shard_size=max_shard_size), out)
            else:
                model_type, kwargs = TINY_ARCHS[name]
                _save_hf(model_type, kwargs, out, max_shard_size)
            built[key] = out
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_reference_dir(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], Path]:
    return lambda name: tiny_checkpoint(DERIVED.get(name, name))


class PagedRunner:
    """Feeds sequences through a CausalLM over one PagedKVCache, allocating blocks from a shuffled free
    list (so a sequence's blocks are not contiguous). `lens[seq]` = tokens committed to the cache."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 256, seed: int = 0) -> None:
        self.model = model
        param = next(model.parameters())
        self.cache = PagedKVCache(
            model.config.num_layers, num_blocks, block_size, model.kv_entry_shape(), param.dtype, param.device
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _reserve(self, seq: int, total: int) -> None:
        table = self.tables.setdefault(seq, [])
        self.lens.setdefault(seq, 0)
        while len(table) * self.cache.block_size < total:
            table.append(self.free.pop())

    def step(
        self,
        seqs: Sequence[int],
        tokens: Sequence[Sequence[int]],
        tree_masks: Sequence[torch.Tensor | None] | None = None,
        positions: Sequence[Sequence[int]] | None = None,
        commit: bool = True,
        capture_layers: tuple[int, ...] = (),
    ):
        """One forward over several sequences' new tokens (written at slots lens[seq] + j)."""
        for s, toks in zip(seqs, tokens):
            self._reserve(s, self.lens.get(s, 0) + len(toks))
        ctx = [self.lens[s] for s in seqs]
        attn = AttentionBatch.contiguous(
            [len(t) for t in tokens], ctx, [self.tables[s] for s in seqs], self.cache.block_size, tree_masks
        )
        if positions is None:
            positions = [range(c, c + len(t)) for c, t in zip(ctx, tokens)]
        device = self.cache.device
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.int64, device=device)
        pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.int64, device=device)
        out = self.model(ids, pos, attn, self.cache, capture_layers=capture_layers)
        if commit:
            for s, t in zip(seqs, tokens):
                self.lens[s] += len(t)
        return out

    def logits(self, out) -> torch.Tensor:  # [T, V]
        return self.model.compute_logits(out.hidden)

    def greedy(self, seq: int, prompt: Sequence[int], new_tokens: int) -> list[int]:
        """Prefill then decode one token per step; returns the new token ids."""
        out = self.step([seq], [list(prompt)])
        generated = [int(self.logits(out)[-1].argmax())]
        while len(generated) < new_tokens:
            out = self.step([seq], [[generated[-1]]])
            generated.append(int(self.logits(out)[-1].argmax()))
        return generated


@pytest.fixture(scope="session")
def paged_runner() -> Callable[..., PagedRunner]:
    return PagedRunner
