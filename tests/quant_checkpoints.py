"""Write tiny quantized checkpoints the way the published ones are, from a tiny float Hugging Face checkpoint.

Each writer returns (quantized checkpoint dir, reference dir). The reference is a plain float32 checkpoint
transformers loads, holding exactly the weights the quantized one encodes (dequantized by this file's own
code, or by compressed-tensors' unpacking for INT4), so "transformers on the dequantized weights" is the oracle.

- ``write_int4``: compressed-tensors ``pack-quantized`` as Kimi-K2-Thinking / K2.5 / K2.6 ship it: only the
  routed experts quantized (int4, symmetric, group 32), packed by compressed-tensors' own compressor, the
  Kimi ``ignore`` list; everything else bf16, e_score_correction_bias float32. ``wrapper=True`` nests it as
  K2.5 / K2.6 do (model_type kimi_k25, text_config, tensors under ``language_model.``, a vision tower).
- ``write_fp8``: FP8 block as DeepSeek-V3 / Qwen3 FP8 ship it: every Linear but the router and lm_head in
  e4m3 with ``weight_scale_inv`` per block (partial edge blocks), scales in the given dtype.
Both are written sharded with an index, a weight and its scales deliberately in different shards.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]


def int4_config(group_size: int = 32) -> dict:
    """quantization_config of Kimi-K2-Thinking (compressed-tensors writes it this way)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": KIMI_IGNORE,
        "kv_cache_scheme": None,
    }


def _write_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """Round-robin over sorted names: a weight and its scale (adjacent names) land in different shards."""
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == file}, str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _start(src: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """Empty out/ and out/reference/ (config copied); the source's float32 tensors."""
    shutil.rmtree(out, ignore_errors=True)
    ref = out / "reference"
    ref.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    (ref / "config.json").write_text(json.dumps(config))
    return config, tensors, ref


def _bf16_unless_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    return t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)


def write_int4(
    src: Path,
    out: Path,
    *,
    group_size: int = 32,
    shape_dtype: torch.dtype = torch.int64,
    wrapper: bool = False,
    shards: int = 3,
) -> tuple[Path, Path]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    config, tensors, ref = _start(src, out)
    stored, reference = {}, {}
    for name, w in tensors.items():
        if not _EXPERT.search(name):
            stored[name] = _bf16_unless_bias(name, w)
            reference[name] = stored[name].float()
            continue
        rows, cols = w.shape
        groups = w.view(rows, cols // group_size, group_size)
        scale = (groups.abs().amax(-1) / 7.0).clamp_min(1e-6).to(torch.bfloat16)  # [rows, cols / group]
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        base = name[: -len(".weight")]
        stored[f"{base}.weight_packed"] = packed["weight_packed"]
        stored[f"{base}.weight_scale"] = packed["weight_scale"]
        stored[f"{base}.weight_shape"] = packed["weight_shape"].to(shape_dtype)
        q = unpack_from_int32(packed["weight_packed"], 4, torch.Size(w.shape))  # compressed-tensors' unpacking
        reference[name] = q.float() * scale.float().repeat_interleave(group_size, dim=1)
    save_file(reference, str(ref / "model.safetensors"))
    if wrapper:
        text = {**config, "quantization_config": int4_config(group_size)}
        config = {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": text,
            "vision_config": {"hidden_size": 8},
        }
        stored = {f"language_model.{n}": t for n, t in stored.items()}
        stored["vision_tower.patch_embed.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
        stored["mm_projector.proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    else:
        config = {**config, "quantization_config": int4_config(group_size)}
    (out / "config.json").write_text(json.dumps(config))
    _write_sharded(stored, out, shards)
    return out, ref


def fp8_quantize(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 [R, C], scale_inv [ceil(R/bo), ceil(C/bi)] in scale_dtype, dequantized [R, C] fp32).

    Padded to whole blocks and viewed as [R/bo, bo, C/bi, bi] (the loader expands scales instead)."""
    rows, cols = w.shape
    bo, bi = block
    nr, nc = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = torch.zeros(nr * bo, nc * bi)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, bo, nc, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-8).to(scale_dtype)  # [nr, nc]
    s = scale.float()[:, None, :, None]
    q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * s).view(nr * bo, nc * bi)[:rows, :cols]
    return q.view(nr * bo, nc * bi)[:rows, :cols].contiguous(), scale, deq.contiguous()


def _fp8_quantized(name: str, t: torch.Tensor) -> bool:
    unquantized = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
    return t.dim() == 2 and name.endswith(".weight") and not name.endswith(unquantized)


def write_fp8(
    src: Path,
    out: Path,
    *,
    block: tuple[int, int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
    not_converted: tuple[str, ...] = (),
    shards: int = 3,
) -> tuple[Path, Path]:
    """not_converted: module names left in bf16 and listed as modules_to_not_convert (Qwen's FP8 key)."""
    config, tensors, ref = _start(src, out)
    stored, reference = {}, {}
    for name, w in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not _fp8_quantized(name, w) or module in not_converted:
            stored[name] = _bf16_unless_bias(name, w)
            reference[name] = stored[name].float()
            continue
        q, scale, deq = fp8_quantize(w, block, scale_dtype)
        stored[name], stored[f"{module}.weight_scale_inv"], reference[name] = q, scale, deq
    save_file(reference, str(ref / "model.safetensors"))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if not_converted:
        quant["modules_to_not_convert"] = list(not_converted)
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    _write_sharded(stored, out, shards)
    return out, ref
