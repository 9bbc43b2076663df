"""Our plain-torch target models against transformers 5 (float32, tiny random checkpoints)."""

from __future__ import annotations

import pytest
import torch

from specserve.models.loader import load_model

NAMES = ("deepseek_v3", "deepseek_v3_plain", "kimi_k2", "qwen3_moe", "mixtral", "llama", "qwen3")
RTOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_logits_match_transformers(name, tiny_checkpoint, hf_reference_dir, paged_runner):
    model, config = load_model(tiny_checkpoint(name), progress=False)
    hf = hf_model(hf_reference_dir(name))
    ids = prompt(13, seed=1)
    runner = paged_runner(model, block_size=4)
    capture = tuple(range(config.num_layers - 1))  # HF ties hidden_states[-1] to the final-norm output
    out = runner.step([0], [ids[:9]], capture_layers=capture)
    prefill_logits = runner.logits(out)
    decode_logits = []
    for tok in ids[9:]:  # single-token decode steps crossing block boundaries (block_size 4)
        decode_logits.append(runner.logits(runner.step([0], [[tok]]))[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    assert rel_err(prefill_logits, ref.logits[0, :9]) < RTOL
    assert rel_err(torch.stack(decode_logits), ref.logits[0, 9:]) < RTOL
    for k, layer in enumerate(capture):
        h = config.hidden_size
        assert rel_err(out.captured[:, k * h : (k + 1) * h], ref.hidden_states[layer + 1][0, :9]) < RTOL
    assert out.captured.shape == (9, len(capture) * config.hidden_size)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers(name, tiny_checkpoint, hf_reference_dir, paged_runner):
    model, _ = load_model(tiny_checkpoint(name), progress=False)
    hf = hf_model(hf_reference_dir(name))
    ids = prompt(7, seed=2)
    ours = paged_runner(model, block_size=4).greedy(0, ids, 32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("name", ("deepseek_v3", "deepseek_v3_plain", "qwen3_moe", "mixtral"))
def test_routed_experts_match_transformers_router(name, tiny_checkpoint, paged_runner):
    model, config = load_model(tiny_checkpoint(name), progress=False)
    hf = hf_model(tiny_checkpoint(name))
    chosen = []
    hooks = [
        hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
        for i in config.moe.layers
    ]
    ids = prompt(10, seed=3)
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    out = paged_runner(model).step([0], [ids])
    assert out.routed_experts.shape == (len(config.moe.layers), 10, config.moe.top_k)
    assert out.routed_experts.dtype == torch.int64
    for ours, ref in zip(out.routed_experts, chosen):
        assert torch.equal(ours.sort(dim=-1).values, ref.sort(dim=-1).values)


def test_dense_model_reports_no_routed_experts(tiny_checkpoint, paged_runner):
    model, _ = load_model(tiny_checkpoint("qwen3"), progress=False)
    out = paged_runner(model).step([0], [prompt(5, seed=4)])
    assert out.routed_experts is None and out.captured is None


@pytest.mark.parametrize("name", ("deepseek_v3", "deepseek_v3_plain"))
def test_shared_experts_as_routed_experts_match_transformers(name, tiny_checkpoint, hf_reference_dir, paged_runner):
    """The fused layers' layout of the shared experts (MoEBlock.set_shared_as_routed: chunks of the routed experts'
    intermediate routed at weight 1 with the top-k) computes transformers' logits, prefill and decode."""
    model, config = load_model(tiny_checkpoint(name), progress=False)
    moe = [layer.mlp for layer in model.model.layers if layer.is_moe]
    for block in moe:
        block.set_shared_as_routed(True)
    assert moe and all(block.shared_as_routed is not None for block in moe)
    hf = hf_model(hf_reference_dir(name))
    ids = prompt(13, seed=4)
    runner = paged_runner(model, block_size=4)
    out = runner.step([0], [ids[:9]])
    assert out.routed_experts.shape[-1] == config.moe.top_k  # the shared chunks are not counted as routed
    logits = [runner.logits(out)] + [runner.logits(runner.step([0], [[tok]])) for tok in ids[9:]]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(torch.cat(logits), ref) < RTOL
