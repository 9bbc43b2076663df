"""Quantized checkpoints as published (INT4 compressed-tensors pack-quantized, FP8 block) against transformers
on the dequantized weights, and under tensor / expert parallel CPU ranks against one process.

The checkpoints are written by tests/quant_checkpoints.py from the tiny float checkpoints (INT4 packed by
compressed-tensors itself), sharded with an index, each weight's scales in another shard than the weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import fp8_quantize, int4_config, write_fp8, write_int4
from safetensors.torch import save_file
from tiny_hf import save_tiny_hf

from specserve.bench.model_bytes import model_bytes
from specserve.cli.main import main
from specserve.contract.types import DraftBlock
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.errors import CheckpointError, ModelConfigError
from specserve.models.loader import load_model
from specserve.models.quant import Fp8BlockConfig, Int4PackConfig
from specserve.models.quant_experts import Fp8StackedExperts, Int4StackedExperts
from specserve.models.quant_sources import open_tensor
from specserve.target_service.engine.engine import TargetEngine
from specserve.target_service.parallel.engine import ParallelTargetEngine

RTOL = 1e-4
PROMPT = [3, 17, 99, 5, 42, 7, 8, 250, 1, 64, 9]
ENGINE_KW = dict(num_blocks=64, block_size=4)
SCALE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """quantized(kind, arch, **writer kwargs) -> (checkpoint dir, reference dir), built once per argument set."""
    built = {}

    def get(kind: str, arch: str = "deepseek_v3", **kw) -> tuple[Path, Path]:
        key = (kind, arch, tuple(sorted(kw.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"{kind}_{arch}")
            writer = write_int4 if kind == "int4" else write_fp8
            src = _wide_experts(tiny_checkpoint("deepseek_v3"), out / "src") if arch == WIDE else tiny_checkpoint(arch)
            built[key] = writer(src, out / "ckpt", **kw)
        return built[key]

    return get


WIDE = "deepseek_v3_wide_experts"  # moe_intermediate_size 64: two int4 groups, so TP = 2 keeps experts packed


def _wide_experts(src: Path, out: Path) -> Path:
    raw = json.loads((src / "config.json").read_text())
    skip = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")
    return save_tiny_hf(
        "deepseek_v3", {**{k: v for k, v in raw.items() if k not in skip}, "moe_intermediate_size": 64}, out
    )


def _experts(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers if layer.is_moe]


def _matches_transformers(ckpt: Path, ref: Path, paged_runner) -> None:
    """Prefill + decode logits (float32) and 24 greedy tokens equal transformers on the reference weights."""
    from transformers import AutoModelForCausalLM

    model, _ = load_model(ckpt, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (12,), generator=g).tolist()
    runner = paged_runner(model, block_size=4)
    prefill = runner.logits(runner.step([0], [ids[:9]]))
    decode = torch.stack([runner.logits(runner.step([0], [[t]]))[0] for t in ids[9:]])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        greedy = hf.generate(torch.tensor([ids[:7]]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert rel_err(prefill, want[:9]) < RTOL
    assert rel_err(decode, want[9:]) < RTOL
    assert paged_runner(model, block_size=4).greedy(1, ids[:7], 24) == greedy[0, 7:].tolist()


@pytest.mark.parametrize("layout", ["kimi_k2", "kimi_k25_wrapper"])
@pytest.mark.parametrize("shape_dtype", [torch.int64, torch.int32], ids=["shape_i64", "shape_i32"])
def test_int4_pack_quantized_matches_transformers(layout, shape_dtype, quantized, paged_runner):
    ckpt, ref = quantized("int4", shape_dtype=shape_dtype, wrapper=layout == "kimi_k25_wrapper")
    config = ModelConfig.from_file(ckpt)
    assert config.quantization == Int4PackConfig(group_size=32, ignore=tuple(int4_config()["ignore"]))
    assert config.checkpoint_prefix == ("language_model." if layout == "kimi_k25_wrapper" else "")
    experts = _experts(load_model(ckpt, progress=False)[0])
    assert all(isinstance(e, Int4StackedExperts) and e.w13.dtype == torch.int32 for e in experts)  # kept packed
    _matches_transformers(ckpt, ref, paged_runner)


def test_int4_experts_split_into_groups_stay_packed_else_load_dequantized(quantized, paged_runner):
    ckpt, ref = quantized("int4", WIDE)
    model, config = load_model(ckpt, progress=False)
    assert config.moe.intermediate_size == 64 and all(isinstance(e, Int4StackedExperts) for e in _experts(model))
    _matches_transformers(ckpt, ref, paged_runner)
    narrow, _ = quantized("int4")  # I = 32 over 2 ranks: 16 columns, not a whole group of 32
    half = load_model(narrow, progress=False, parallel=ParallelConfig(tp_rank=1, tp_size=2))[0]
    assert not any(isinstance(e, Int4StackedExperts) for e in _experts(half))
    assert all(
        isinstance(e, Int4StackedExperts)
        for e in _experts(load_model(narrow, progress=False, parallel=ParallelConfig(tp_rank=1, tp_size=2, ep=True))[0])
    )


@pytest.mark.parametrize("scale", list(SCALE_DTYPES))
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_fp8_block_matches_transformers(arch, scale, quantized, paged_runner):
    """Blocks of 20 x 24: partial edge blocks everywhere (kv_a 24 x 64 has a 2 x 3 scale, the last block
    4 x 16), and tensor-parallel row splits that start mid-block."""
    not_converted = ("model.layers.0.self_attn.o_proj",) if arch == "qwen3_moe" else ()
    ckpt, ref = quantized("fp8", arch, block=(20, 24), scale_dtype=SCALE_DTYPES[scale], not_converted=not_converted)
    assert ModelConfig.from_file(ckpt).quantization == Fp8BlockConfig(block=(20, 24), not_converted=not_converted)
    _matches_transformers(ckpt, ref, paged_runner)


@pytest.mark.parametrize("scale", ["f32", "bf16"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_fp8_experts_on_whole_blocks_stay_packed(arch, scale, quantized, paged_runner):
    """Blocks of 16 x 24: I = 32 is two row blocks, so the experts are held in e4m3 with their scales (blocks
    of 20 rows above cut gate from up: those load dequantized); the rest of the model loads dequantized."""
    ckpt, ref = quantized("fp8", arch, block=(16, 24), scale_dtype=SCALE_DTYPES[scale])
    experts = _experts(load_model(ckpt, progress=False)[0])
    assert experts and all(isinstance(e, Fp8StackedExperts) and e.w13.dtype == torch.float8_e4m3fn for e in experts)
    _matches_transformers(ckpt, ref, paged_runner)
    blocks20, _ = quantized("fp8", arch, block=(20, 24), scale_dtype=SCALE_DTYPES[scale])
    assert not any(isinstance(e, Fp8StackedExperts) for e in _experts(load_model(blocks20, progress=False)[0]))


def test_fp8_published_block_size_matches_transformers(quantized, paged_runner):
    ckpt, ref = quantized("fp8", block=(128, 128))  # DeepSeek-V3's [128, 128]: every tiny weight is one partial block
    _matches_transformers(ckpt, ref, paged_runner)


@pytest.mark.parametrize("ranks,ep", [(2, False), (2, True)], ids=["tp2", "tp2_ep"])
@pytest.mark.parametrize("kind", ["int4", "int4_wide", "fp8", "fp8_packed"])
def test_parallel_ranks_match_one_process(kind, ranks, ep, quantized):
    """int4: TP = 2 loads the 32-wide experts dequantized, EP keeps them packed; int4_wide: each TP rank keeps
    its 32-column half of every expert packed (the down projection split between groups); fp8: blocks of
    20 x 24, experts dequantized, attention split mid-block; fp8_packed: blocks of 16, experts held in e4m3
    with each TP rank's 16 rows / columns of every expert."""
    kw = {
        "int4": {},
        "int4_wide": {},
        "fp8": {"block": (20, 24), "scale_dtype": torch.bfloat16},
        "fp8_packed": {"block": (16, 16), "scale_dtype": torch.float32},
    }[kind]
    ckpt, _ = quantized(kind[:4].rstrip("_"), WIDE if kind == "int4_wide" else "deepseek_v3", **kw)
    if kind == "fp8_packed":
        half = load_model(ckpt, progress=False, parallel=ParallelConfig(tp_rank=1, tp_size=2, ep=ep))[0]
        assert all(isinstance(e, Fp8StackedExperts) for e in _experts(half))
    model, config = load_model(ckpt, progress=False)
    ref = TargetEngine(model, config, **ENGINE_KW)
    tree = DraftBlock(token_ids=(11, 12, 13, 14, 15), parents=(-1, 0, 0, 1, -1))
    ref.prefill("a", PROMPT)
    want_scores = ref.score_block("a", tree)
    want = ref.generate_greedy(PROMPT, 12)
    with ParallelTargetEngine(
        ckpt, tensor_parallel_size=ranks, expert_parallel=ep, progress=False, **ENGINE_KW
    ) as engine:
        engine.prefill("a", PROMPT)
        torch.testing.assert_close(engine.score_block("a", tree), want_scores, atol=1e-5, rtol=1e-5)
        assert engine.generate_greedy(PROMPT, 12) == want


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_generate_serves_the_quantized_checkpoint(kind, quantized, capsys):
    """`specserve generate` (was: "quantized checkpoints are not supported") decodes what one engine does."""
    ckpt, _ = quantized(kind, **({"block": (20, 24), "scale_dtype": torch.bfloat16} if kind == "fp8" else {}))
    model, config = load_model(ckpt, progress=False)
    want = TargetEngine(model, config, **ENGINE_KW).generate_greedy(PROMPT, 10)
    capsys.readouterr()
    argv = [
        "generate",
        "--model",
        str(ckpt),
        "--prompt-ids",
        ",".join(map(str, PROMPT)),
        "--max-new-tokens",
        "10",
        "--draft",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--num-kv-blocks",
        "64",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want


class _Recorder:
    """A safetensors file handle that records which [rows, cols] ranges of each tensor are read."""

    def __init__(self, handle, reads: dict) -> None:
        self.handle, self.reads = handle, reads

    def get_slice(self, name: str):
        inner, reads = self.handle.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def get_dtype(self):
                return inner.get_dtype()

            def __getitem__(self, key):
                t = inner[key]
                reads.setdefault(name, []).append(tuple(t.shape))
                return t

        return Slice()


def _handles(tensors: dict, path: Path, reads: dict) -> dict:
    from safetensors import safe_open

    save_file(tensors, str(path))
    handle = safe_open(str(path), framework="pt")
    return dict.fromkeys(tensors, _Recorder(handle, reads))


def test_a_rank_reads_only_its_shard_of_packed_words_and_scales(tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (16, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(16, 8, generator=g).to(torch.bfloat16)
    tensors = {
        "m.weight_packed": pack_to_int32(q, 4),
        "m.weight_scale": scale,
        "m.weight_shape": torch.tensor([16, 256]),
    }
    reads = {}
    name, view = open_tensor("m.weight_packed", _handles(tensors, tmp_path / "a.safetensors", reads), Int4PackConfig())
    assert name == "m.weight" and view.shape == (16, 256)
    reads.clear()
    half = view.narrow(1, 128, 128).materialize()  # row-parallel rank 1 of 2: input columns 128..255
    assert reads == {"m.weight_packed": [(16, 16)], "m.weight_scale": [(16, 4)]}
    want = q[:, 128:].float() * scale[:, 4:].float().repeat_interleave(32, dim=1)
    assert torch.equal(half, want)
    reads.clear()
    mid = view.narrow(0, 4, 8).narrow(1, 40, 50).materialize()  # starts inside a group and a word
    assert reads == {"m.weight_packed": [(8, 12 - 4)], "m.weight_scale": [(8, 2)]}
    assert torch.equal(mid, q[4:12, 40:90].float() * scale[4:12].float().repeat_interleave(32, dim=1)[:, 40:90])

    w = torch.randn(60, 96, generator=g)
    w8, s, deq = fp8_quantize(w, (20, 24), torch.float32)
    reads = {}
    handles = _handles({"f.weight": w8, "f.weight_scale_inv": s}, tmp_path / "b.safetensors", reads)
    name, view = open_tensor("f.weight", handles, Fp8BlockConfig(block=(20, 24)))
    rows = view.narrow(0, 30, 30).materialize()  # column-parallel rank 1 of 2: rows 30..59, from mid-block
    assert reads == {"f.weight": [(30, 96)], "f.weight_scale_inv": [(2, 4)]}
    assert torch.equal(rows, deq[30:])


def _int4_raw(tiny_checkpoint) -> dict:
    return {
        **json.loads((tiny_checkpoint("deepseek_v3") / "config.json").read_text()),
        "quantization_config": int4_config(),
    }


@pytest.mark.parametrize(
    "quantization,named",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size None"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "activation_scheme 'static'",
        ),
        ({**int4_config(), "format": "float-quantized"}, "format 'float-quantized'"),
        (
            {
                **int4_config(),
                "config_groups": {
                    "g": {
                        "format": "pack-quantized",
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "symmetric": False,
                            "strategy": "group",
                            "group_size": 32,
                        },
                    }
                },
            },
            "'symmetric': False",
        ),
        (
            {
                **int4_config(),
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
                },
            },
            "'num_bits': 8",
        ),
    ],
    ids=["awq", "gptq", "bnb", "fp8_no_block", "fp8_static", "ct_float", "ct_asymmetric", "ct_int8"],
)
def test_other_quantizations_are_refused_in_one_line(quantization, named, tiny_checkpoint):
    with pytest.raises(ModelConfigError, match=named) as err:
        ModelConfig.from_dict({**_int4_raw(tiny_checkpoint), "quantization_config": quantization})
    assert "\n" not in str(err.value) and "supported: compressed-tensors (pack-quantized int4" in str(err.value)


def test_generate_refuses_an_awq_checkpoint_with_one_line(tiny_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "awq"
    ckpt.mkdir()
    raw = {**_int4_raw(tiny_checkpoint), "quantization_config": {"quant_method": "awq"}}
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert "quant_method 'awq' are not supported" in err and "\n" not in err and "Traceback" not in err


def test_broken_quantized_tensors_are_named(quantized, tmp_path):
    from safetensors import safe_open

    ckpt, _ = quantized("int4")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / file), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    save_file({**tensors, victim: tensors[victim][:, :0].contiguous()}, str(bad / "model.safetensors"))
    wrong = r"experts.3.down_proj.weight_scale is BF16 \[64, 0\]; .* needs F32/BF16/F16 \[64, 1\]"
    with pytest.raises(CheckpointError, match=wrong):
        load_model(bad, progress=False)
    save_file({n: t for n, t in tensors.items() if n != victim}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"has no {victim} in the checkpoint"):
        load_model(bad, progress=False)


def test_bytes_floor_counts_packed_weights_and_scales(quantized, tiny_checkpoint):
    """One routed expert costs what the checkpoint stores for it (packed words + bf16 group scales;
    fp8 bytes + float32 block scales), and fp8 attention likewise, not the dequantized floats."""
    cases = (
        ("int4", {}),
        ("fp8", {"block": (20, 24), "scale_dtype": torch.float32}),  # experts packed; dequantized
        ("fp8", {"block": (16, 24), "scale_dtype": torch.float32}),
    )  # fp8 experts held packed
    for kind, kw in cases:
        ckpt, _ = quantized(kind, **kw)
        stored = _stored(ckpt)

        def nbytes(prefix: str, part: str = "", without: str = "weight_shape", stored=stored) -> int:
            return sum(b for n, b in stored.items() if n.startswith(prefix) and part in n and without not in n)

        model, config = load_model(ckpt, progress=False)
        counted = model_bytes(model, config)
        assert counted.expert_bytes == nbytes("model.layers.1.mlp.experts.0.")
        float_bytes = model_bytes(*load_model(tiny_checkpoint("deepseek_v3"), progress=False))
        assert counted.expert_bytes < float_bytes.expert_bytes / 3  # float32 -> 4 (fp8) / ~8 (int4) bits + scales
        if kind == "fp8":
            # the attention's own norms (q_a / kv_a) count as role "norm"
            assert counted.dense_bytes["attention"] == nbytes("model.layers.", ".self_attn.", "norm")
        else:
            assert counted.dense_bytes["attention"] == float_bytes.dense_bytes["attention"]


def _stored(ckpt: Path) -> dict[str, int]:
    """Stored bytes of every tensor but the weight_shape pairs (metadata, not read by a step)."""
    from safetensors import safe_open

    size = {"I32": 4, "BF16": 2, "F32": 4, "F8_E4M3": 1}
    out = {}
    for file in ckpt.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for n in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                s = f.get_slice(n)
                if not n.endswith("weight_shape"):
                    out[n] = int(torch.Size(s.get_shape()).numel()) * size[s.get_dtype()]
    return out
