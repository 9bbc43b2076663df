"""Fixtures for drafter tests: tiny random checkpoints written by transformers' save_pretrained; every
test here runs torch on one thread (tests/conftest.py).

    tiny_ckpt(kind) -> Path   session-scoped; kind in {"target_moe", "target_dense", "draft_llama",
                              "draft_moe", "draft_other_vocab", "target_mtp"}; hidden 32, vocab 64 (other:
                              72), a WordLevel tokenizer.json with 64 tokens for all but "draft_other_vocab".
                              "target_mtp": DeepSeek-V3 (MLA, YaRN rope, sigmoid grouped routing, 1 dense +
                              1 MoE layer) with one multi-token-prediction layer 2 (tiny_hf.save_tiny_deepseek_mtp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_hf import TINY_DEEPSEEK_MTP, save_tiny_deepseek_mtp, save_tiny_hf

_COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
_MOE = dict(
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
KINDS = {
    "target_moe": ("qwen3_moe", dict(_COMMON, **_MOE, vocab_size=64, num_hidden_layers=3), 0),
    "target_dense": ("llama", dict(_COMMON, vocab_size=64, num_hidden_layers=3), 4),
    "draft_llama": ("llama", dict(_COMMON, vocab_size=64, num_hidden_layers=1), 1),
    "draft_moe": ("qwen3_moe", dict(_COMMON, **_MOE, vocab_size=64, num_hidden_layers=1), 2),
    "draft_other_vocab": ("llama", dict(_COMMON, vocab_size=72, num_hidden_layers=1), 3),
}


def _tokenizer_json(vocab: int) -> str:
    return json.dumps(
        {
            "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"},
            "added_tokens": [],
        }
    )


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    built: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in built:
            out = tmp_path_factory.mktemp("draft_ckpt") / kind
            if kind == "target_mtp":
                kw = TINY_DEEPSEEK_MTP
                save_tiny_deepseek_mtp(kw, out, seed=5)
            else:
                model_type, kw, seed = KINDS[kind]
                save_tiny_hf(model_type, kw, out, seed=seed)
            if kind != "draft_other_vocab":
                (out / "tokenizer.json").write_text(_tokenizer_json(kw["vocab_size"]))
            built[kind] = out
        return built[kind]

    return make
