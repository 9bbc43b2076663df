"""A tiny random EAGLE-3 head in the published layout, and the target folder it reads its embeddings from."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from specserve.draft_service.eagle3_head import Eagle3Config, Eagle3Head, save_eagle3_head

VOCAB, DRAFT_VOCAB, H, TARGET_H, TARGET_LAYERS = 48, 32, 16, 12, 6


def head_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": TARGET_H,
        "hidden_act": "silu",
    }


def random_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(head_config()))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        draft_to_target = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
        head.d2t.copy_(draft_to_target - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[draft_to_target] = True
    return head


def write_target(tmp_path, embed: torch.Tensor):
    """A target checkpoint folder with just what the head needs: config.json + embeddings."""
    tdir = tmp_path / "target"
    tdir.mkdir()
    cfg = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": TARGET_H,
        "num_hidden_layers": TARGET_LAYERS,
        "intermediate_size": 24,
        "num_attention_heads": 2,
    }
    (tdir / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": embed.contiguous()}, str(tdir / "model.safetensors"))
    return tdir


def save_tiny_eagle3(root):
    """(the random head, its folder in the published layout without embeddings, the target folder it reads them
    from), written under root."""
    head = random_head()
    hdir = root / "head"
    save_eagle3_head(head, hdir)  # published layout, no embeddings
    tdir = write_target(root, head.embed_tokens.weight.detach().clone())
    return head, hdir, tdir
