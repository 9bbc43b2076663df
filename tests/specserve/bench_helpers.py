"""Tiny checkpoints for the bench tests (fixtures in conftest.py): a random DeepSeek-V3-architecture MoE target (the demo's
architecture) and a random Llama draft LM, both saved with transformers' save_pretrained, sharing a
small byte-level BPE tokenizer.json trained on the bench prompts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_hf import save_tiny_hf

VOCAB = 320


def save_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from specserve.bench.prompts import load_prompt_set

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [p.text for p in load_prompt_set().prompts]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def save_checkpoint(model_type: str, kwargs: dict, out: Path) -> Path:
    save_tiny_hf(model_type, kwargs, out)
    save_tokenizer(out)
    return out


TARGET = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)
DRAFT_LM = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    eos_token_id=0,
    bos_token_id=0,
    pad_token_id=0,
)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_eagle3(out: Path, seed: int = 0) -> Path:
    """A random EAGLE-3 head for the TARGET above (published layout; embeddings come from the target)."""
    from specserve.draft_service.eagle3_head import (
        Eagle3Config,
        Eagle3Head,
        save_eagle3_head,
    )

    h = TARGET["hidden_size"]
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
        "target_hidden_size": h,
        "hidden_act": "silu",
    }
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(raw))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        head.d2t.zero_()  # draft vocabulary = the target's
        head.t2d.fill_(True)
    save_eagle3_head(head, out)
    return out
