"""Synthetic presets, backend selection and the fast-path plumbing on CPU (tiny presets; the GPU side is in
test_gpu_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.contract.types import DraftBlock
from specserve.errors import SpecserveError
from specserve.kernels.attention import pack_tree_mask
from specserve.kernels.paged_batch import PagedBatch
from specserve.models.attn_backend import AttentionBackendError
from specserve.models.backends import select_backends
from specserve.models.config import GQAConfig, MLAConfig
from specserve.models.errors import ModelConfigError
from specserve.models.presets import (
    PRESETS,
    build_synthetic_model,
    parameter_bytes,
    parse_spec,
    synthetic_config,
)
from specserve.target_service.engine.model_runner import GraphCaptureError, GraphOptions
from specserve.target_service.factory import EngineConfig, build_engine


def test_qwen3_30b_a3b_preset_matches_the_public_config():
    c = synthetic_config("qwen3-30b-a3b")
    assert (c.model_type, c.num_layers, c.hidden_size, c.vocab_size) == ("qwen3_moe", 48, 2048, 151936)
    assert isinstance(c.attention, GQAConfig)
    assert (c.attention.num_heads, c.attention.num_kv_heads, c.attention.head_dim, c.attention.qk_norm) == (
        32,
        4,
        128,
        True,
    )
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (128, 8, 768)
    assert c.moe.layers == tuple(range(48))


def test_kimi_k2_layer_preset_matches_the_public_config():
    c = synthetic_config("synthetic:kimi-k2-layer")
    a = c.attention
    assert isinstance(a, MLAConfig)
    assert (c.num_layers, c.hidden_size, a.num_heads, a.q_lora_rank, a.kv_lora_rank) == (1, 7168, 64, 1536, 512)
    assert (a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim) == (64, 128, 128)
    m = c.moe
    assert (m.num_experts, m.top_k, m.n_shared_experts, m.intermediate_size, m.layers) == (384, 8, 1, 2048, (0,))
    assert (m.scoring, m.correction_bias) == ("sigmoid", True)
    deeper = synthetic_config("kimi-k2-layer:3")
    assert deeper.num_layers == 3 and deeper.moe.layers == (0, 1, 2)


def test_layer_count_cuts_the_moe_layers():
    c = synthetic_config("synthetic:qwen3-30b-a3b:4")
    assert c.num_layers == 4 and c.moe.layers == (0, 1, 2, 3)
    mini = synthetic_config("mini-kimi-k2:1")
    assert mini.num_layers == 1 and mini.moe.layers == ()  # its first layer is dense


@pytest.mark.parametrize("spec", ["nosuch", "synthetic:nosuch:2", "qwen3-30b-a3b:0", "qwen3-30b-a3b:x"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ModelConfigError):
        parse_spec(spec)


def test_presets_table_is_frozen():
    with pytest.raises(TypeError):
        PRESETS["new"] = PRESETS["tiny-qwen3-moe"]  # type: ignore[index]


def test_qwen_decode_floor_is_the_expected_1_43_ms():
    b = parameter_bytes(synthetic_config("qwen3-30b-a3b"))
    assert b["expert"] == 3 * 2048 * 768 * 2
    decode = b["dense"] + 8 * b["moe_layers"] * b["expert"]  # one token: 8 experts per layer
    assert decode / 4.26e12 * 1e3 == pytest.approx(1.43, abs=0.02)


def test_random_weights_are_nonzero_seeded_and_bf16():
    model, _ = build_synthetic_model("tiny-kimi-k2", seed=3)
    again, _ = build_synthetic_model("tiny-kimi-k2", seed=3)
    other, _ = build_synthetic_model("tiny-kimi-k2", seed=4)
    for (name, p), q, r in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert p.dtype in (torch.bfloat16, torch.float32), name  # the noaux bias stays float32
        assert p.device.type == "cpu"
        assert bool((p != 0).any()), name
        assert torch.equal(p, q), name
        assert not torch.equal(p, r), name
        if name.endswith("norm.weight"):
            assert float(p.float().mean()) == pytest.approx(1.0, abs=0.05)


def test_int4_presets_keep_kimi_experts_packed():
    b, full = (
        parameter_bytes(synthetic_config("kimi-k2-layer-int4")),
        parameter_bytes(synthetic_config("kimi-k2-layer")),
    )
    # per expert: gate + up [2048, 7168] and down [7168, 2048] as int32 words (8 values) + bf16 scales per 32
    assert b["expert"] == 2 * 2048 * (7168 // 8 * 4 + 7168 // 32 * 2) + 7168 * (2048 // 8 * 4 + 2048 // 32 * 2)
    assert (b["dense"], b["embed"]) == (full["dense"], full["embed"]) and full["expert"] == 3 * 2048 * 7168 * 2
    model, _ = build_synthetic_model("tiny-kimi-k2-int4", seed=3)
    other, _ = build_synthetic_model("tiny-kimi-k2-int4", seed=4)
    experts = model.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.int32 and experts.w13_scale.dtype == torch.bfloat16
    for p, q in zip(experts.parameters(), other.model.layers[1].mlp.experts.parameters(), strict=True):
        assert bool((p != 0).any()) and not torch.equal(p, q)
    engine = build_engine(EngineConfig(model="synthetic:tiny-kimi-k2-int4", num_kv_blocks=64, kv_block_size=4))
    assert len(engine.generate_greedy([1, 2, 3, 4, 5], 6)) == 6


def test_fp8_presets_keep_experts_in_e4m3():
    b, full = parameter_bytes(synthetic_config("qwen3-30b-a3b-fp8")), parameter_bytes(synthetic_config("qwen3-30b-a3b"))
    # per expert: gate + up [768, 2048] and down [2048, 768] in e4m3 + a float32 scale per 128 x 128 block
    assert b["expert"] == 3 * 768 * 2048 + (2 * 6 * 16 + 16 * 6) * 4 and full["expert"] == 2 * 3 * 768 * 2048
    model, _ = build_synthetic_model("tiny-qwen3-moe-fp8", seed=3)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.shape == (8, 4, 4)
    assert all(bool(torch.isfinite(p.float()).all() and (p.float() != 0).any()) for p in experts.parameters())
    engine = build_engine(EngineConfig(model="synthetic:tiny-qwen3-moe-fp8", num_kv_blocks=64, kv_block_size=4))
    assert len(engine.generate_greedy([1, 2, 3, 4, 5], 6)) == 6


def test_synthetic_engine_on_cpu_generates():
    engine = build_engine(EngineConfig(model="synthetic:tiny-qwen3-moe", num_kv_blocks=64, kv_block_size=4))
    out = engine.generate_greedy([1, 2, 3, 4, 5], 6)
    assert len(out) == 6 and all(0 <= t < 256 for t in out)
    assert engine.info().model_type == "qwen3_moe"


def test_engine_config_refusals():
    with pytest.raises(SpecserveError, match="unknown synthetic preset"):
        EngineConfig(model="synthetic:nosuch")
    with pytest.raises(SpecserveError, match="cuda"):
        EngineConfig(model="synthetic:tiny-qwen3-moe", cuda_graphs=True)


def test_backend_selection_on_cpu():
    cfg = synthetic_config("tiny-qwen3-moe")
    choice = select_backends(cfg, "cpu", torch.bfloat16)
    assert (choice.attention, choice.moe) == ("torch", "torch")
    with pytest.raises(AttentionBackendError, match="FlashInfer"):
        select_backends(cfg, "cpu", torch.bfloat16, attention="flashinfer")
    with pytest.raises(AttentionBackendError, match="fused MoE"):
        select_backends(cfg, "cpu", torch.bfloat16, moe="fused")
    with pytest.raises(AttentionBackendError):
        select_backends(cfg, "cpu", torch.bfloat16, attention="nonsense")


def test_cuda_graphs_refused_on_cpu():
    engine = build_engine(EngineConfig(model="synthetic:tiny-qwen3-moe", num_kv_blocks=16, kv_block_size=4))
    with pytest.raises(GraphCaptureError):
        engine.runner.capture(GraphOptions(chain_sizes=(1,)))


def test_packed_tree_mask_segments_start_at_their_bit_offsets():
    masks = [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), None]
    batch = PagedBatch.build([3, 2], [5, 9], [[0, 1], [2, 3, 4]], 4, masks)
    packed = pack_tree_mask(batch).numpy()
    start = 0
    for b in range(batch.num_requests):
        want = batch.request_mask(b).reshape(-1).numpy()
        got = np.unpackbits(packed[start:], bitorder="little")[: want.size].astype(bool)
        assert np.array_equal(got, want)
        start += want.size  # FlashInfer's mask_indptr: bit offsets used as byte offsets


@pytest.mark.parametrize("backend", ["reference", "paged_torch"])
@pytest.mark.parametrize("spec", ["tiny-qwen3-moe", "tiny-kimi-k2"])
def test_fast_path_plumbing_matches_torch_attention(spec, backend):
    """The reference backend (per-step prepare, slot writes, absorbed MLA) and the graph-safe paged torch backend
    (static-shape windows through the block table) == plain-torch attention: prefill, chain verify, tree verify,
    greedy decode."""
    engines = [
        build_engine(
            EngineConfig(model=f"synthetic:{spec}", num_kv_blocks=64, kv_block_size=4, seed=1, attention_backend=kind)
        )
        for kind in ("torch", backend)
    ]
    assert (
        type(engines[1].model.attn_backend).__name__
        == {"reference": "ReferencePagedBackend", "paged_torch": "PagedTorchBackend"}[backend]
    )
    assert engines[0].kv_cache.dtype == torch.float32  # EngineConfig's default dtype: a tight comparison
    prompt = list(range(3, 21))
    chain = DraftBlock(token_ids=(7, 8, 9))
    tree = DraftBlock(token_ids=(7, 8, 11, 12), parents=(-1, 0, -1, 2))
    results = []
    for e in engines:
        e.prefill("s", prompt)
        results.append((e.score_block("s", chain), e.score_block("s", tree), e.generate_greedy(prompt, 5)))
    (c0, t0, g0), (c1, t1, g1) = results
    torch.testing.assert_close(c1, c0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t1, t0, rtol=1e-4, atol=1e-4)
    assert g0 == g1
