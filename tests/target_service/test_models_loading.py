"""Checkpoint loading: sharded files, fused expert layouts, and errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from specserve.models.errors import CheckpointError, ModelConfigError, UnsupportedModelError
from specserve.models.loader import load_model, load_tokenizer


def copy_ckpt(tiny_checkpoint, name, tmp_path, **kw):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(name, **kw), dst)
    return dst


def same_params(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_unknown_model_type_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict({"model_type": "gpt_neox_moe", "hidden_size": 8})
    msg = str(err.value)
    assert "gpt_neox_moe" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)
    assert set(SUPPORTED_MODEL_TYPES) >= {"deepseek_v3", "kimi_k2", "qwen3_moe", "mixtral", "llama", "qwen3"}


def test_bad_config_values_are_named(tiny_checkpoint):
    raw = json.loads((tiny_checkpoint("qwen3_moe") / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_experts_per_tok"})
    with pytest.raises(ModelConfigError, match="top_k 9 > num_experts 8"):
        ModelConfig.from_dict({**raw, "num_experts_per_tok": 9})
    with pytest.raises(ModelConfigError, match="quant_method 'awq'"):  # more cases: test_quantized_checkpoints.py
        ModelConfig.from_dict({**raw, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ModelConfigError, match="rope_type 'longrope'"):
        ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


def test_parsed_features(tiny_checkpoint):
    ds = ModelConfig.from_file(tiny_checkpoint("deepseek_v3"))
    assert ds.moe.layers == (1, 2) and ds.moe.scoring == "sigmoid" and ds.moe.correction_bias
    assert ds.kv_entry_shape == (16 + 8,) and ds.rope.rope_type == "yarn"
    kimi = ModelConfig.from_file(tiny_checkpoint("kimi_k2"))
    assert kimi.rope == ds.rope and kimi.moe == ds.moe and kimi.attention == ds.attention
    qm = ModelConfig.from_file(tiny_checkpoint("qwen3_moe"))
    assert qm.moe.layers == (0, 2) and qm.kv_entry_shape == (2, 2, 16)
    assert ModelConfig.from_file(tiny_checkpoint("llama")).tie_word_embeddings


def test_sharded_checkpoint_loads_same_weights(tiny_checkpoint):
    sharded = tiny_checkpoint("deepseek_v3", max_shard_size="100KB")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").exists()
    a, _ = load_model(sharded, progress=False)
    b, _ = load_model(tiny_checkpoint("deepseek_v3"), progress=False)
    assert same_params(a, b)


def test_fused_expert_layout_loads_same_weights(tiny_checkpoint, tmp_path):
    """transformers-5 in-memory layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    ckpt = copy_ckpt(tiny_checkpoint, "qwen3_moe", tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{pre}.{e}.gate_proj.weight") for e in range(8)]
        up = [tensors.pop(f"{pre}.{e}.up_proj.weight") for e in range(8)]
        down = [tensors.pop(f"{pre}.{e}.down_proj.weight") for e in range(8)]
        tensors[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{pre}.down_proj"] = torch.stack(down)
    save_file(tensors, ckpt / "model.safetensors")
    fused, _ = load_model(ckpt, progress=False)
    ref, _ = load_model(tiny_checkpoint("qwen3_moe"), progress=False)
    assert same_params(fused, ref)


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    ckpt = copy_ckpt(tiny_checkpoint, "mixtral", tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt, progress=False)
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in msg
    assert "model.safetensors" in msg


def test_misshaped_tensor_is_named_with_its_file(tiny_checkpoint, tmp_path):
    ckpt = copy_ckpt(tiny_checkpoint, "deepseek_v3", tmp_path, max_shard_size="100KB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    file = ckpt / index[name]
    tensors = load_file(file)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt, progress=False)
    assert name in str(err.value) and index[name] in str(err.value) and "(128, 16)" in str(err.value)


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    ckpt = copy_ckpt(tiny_checkpoint, "qwen3", tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.weight_scale_inv"] = torch.ones(2)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored, as transformers does
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        load_model(ckpt, progress=False)


def test_truncated_file_is_named(tiny_checkpoint, tmp_path):
    ckpt = copy_ckpt(tiny_checkpoint, "llama", tmp_path)
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt, progress=False)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(ckpt, progress=False)


def test_missing_files_are_named(tiny_checkpoint, tmp_path):
    ckpt = copy_ckpt(tiny_checkpoint, "llama", tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(ckpt, progress=False)
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model(tmp_path / "nowhere", progress=False)


def test_tied_embeddings_use_the_embedding_table(tiny_checkpoint):
    model, config = load_model(tiny_checkpoint("llama"), progress=False)
    assert config.tie_word_embeddings and model.lm_head is None
    h = torch.randn(3, config.hidden_size)
    assert torch.equal(model.compute_logits(h), h @ model.model.embed_tokens.weight.t())
    assert model.compute_logits(h).dtype == torch.float32


def test_bfloat16_load_keeps_router_bias_fp32(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("deepseek_v3"), dtype=torch.bfloat16, progress=False)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16


def test_tokenizer_absent_or_loaded(tiny_checkpoint, tmp_path):
    from tokenizers import Tokenizer, models

    assert load_tokenizer(tiny_checkpoint("llama")) is None
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).token_to_id("a") == 0
