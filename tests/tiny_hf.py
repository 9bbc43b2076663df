"""One way to write a tiny random Hugging Face checkpoint for tests: transformers' own model class,
random weights from a fixed seed, float32, written with save_pretrained (the oracle our loader and
models are compared against)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_hf(model_type: str, kwargs: dict, out: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Build transformers' model for ``model_type`` from ``kwargs`` with seed ``seed`` and save it to ``out``.

    DeepSeek-V3's e_score_correction_bias buffer starts at zero in transformers; it gets small random
    values here so that the routing bias is exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return out


# The service and target tests' tiny targets (vocab 256: one byte a token; hidden 64, 2 layers), before each
# family's own fields; the qwen3_moe fields both use (with their own layers and mlp_only_layers).
TINY_BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits and routing: no near-ties between HF and us
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
TINY_QWEN3_MOE = dict(
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
)

TINY_ZLAB_DFLASH = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=64,
    block_size=5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)
TINY_DEEPSEEK_MTP = dict(  # hidden 32, vocab 64, layers 0 (dense) and 1 (MoE), MTP layer 2
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    initializer_range=0.2,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    rope_interleave=True,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=0.8,
        beta_fast=32,
        beta_slow=1,
    ),
)


def save_tiny_deepseek_mtp(kwargs: dict, out: Path, *, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 checkpoint of N = kwargs["num_hidden_layers"] layers that carries one
    multi-token-prediction layer, as the published checkpoints do (``num_nextn_predict_layers: 1``).

    transformers' model of N + 1 layers is saved, so layer N's decoder block (MLA + MoE) is a random
    transformers block written in the same format as the others; config.json then says N layers, and
    layer N gains eh_proj [H, 2H], enorm, hnorm, shared_head.norm and embed_tokens / shared_head.head
    (copies of the main embedding and head). Every norm weight is random near 1 (transformers starts them
    at 1, which would hide a norm applied twice or not at all). transformers loads it as an N-layer model
    (layer N's tensors unexpected, ignored)."""
    import json

    from safetensors.torch import load_file, save_file

    n, h = kwargs["num_hidden_layers"], kwargs["hidden_size"]
    save_tiny_hf("deepseek_v3", dict(kwargs, num_hidden_layers=n + 1), out, seed=seed)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    for name in sorted(tensors):
        if name.endswith("norm.weight"):
            tensors[name] = tensors[name] * (1 + 0.2 * torch.randn(tensors[name].shape, generator=g))
    p = f"model.layers.{n}."
    tensors.update(
        {
            p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.2,
            p + "enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            p + "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            p + "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
            p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
            p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        }
    )
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def save_zlab_dflash(out: Path, target_layer_ids=(0, 2), seed: int = 0, mask_token_id: int = 63, **overrides) -> Path:
    """A DFlash drafter in z-lab's published layout (config.json of a qwen3 ``DFlashDraftModel`` +
    model.safetensors without embeddings or head), random weights (norm weights near 1); ``overrides``
    change TINY_ZLAB_DFLASH's fields (hidden 32 and vocab 64 fit the tiny drafting targets)."""
    import json

    from safetensors.torch import save_file

    cfg = dict(TINY_ZLAB_DFLASH, **overrides)
    g = torch.Generator().manual_seed(seed)
    h, d, nh, nkv, i = (
        cfg["hidden_size"],
        cfg["head_dim"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )

    def w(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).float()

    def norm(n):
        return (1.0 + 0.2 * torch.randn(n, generator=g)).float()

    t = {"fc.weight": w(h, len(target_layer_ids) * h, scale=0.2), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        t.update(
            {
                p + "self_attn.q_proj.weight": w(nh * d, h),
                p + "self_attn.k_proj.weight": w(nkv * d, h),
                p + "self_attn.v_proj.weight": w(nkv * d, h),
                p + "self_attn.o_proj.weight": w(h, nh * d),
                p + "self_attn.q_norm.weight": norm(d),
                p + "self_attn.k_norm.weight": norm(d),
                p + "mlp.gate_proj.weight": w(i, h),
                p + "mlp.up_proj.weight": w(i, h),
                p + "mlp.down_proj.weight": w(h, i),
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"))
    config = dict(
        cfg,
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        torch_dtype="float32",
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * cfg["num_hidden_layers"],
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
