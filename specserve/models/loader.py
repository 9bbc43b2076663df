"""Load a Hugging Face-format checkpoint directory (config.json + safetensors) into a CausalLM.

Tensors are streamed one at a time from safetensors files straight into their (pre-allocated)
parameters through each parameter's weight_loader, so the weights never exist twice in memory. Each
tensor reaches its loader as a lazy ``CheckpointSlice`` (safetensors ``get_slice``): a tensor-parallel
rank reads only the bytes of its own shard, and nothing of routed experts held by other ranks.
Quantized checkpoints (int4 pack-quantized, fp8 block; models/quant.py) load the same way: each
quantized Linear reaches its loader as one lazy tensor that dequantizes just the view it is asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.models import quant_sources, weight_names
from specserve.models.causal_lm import CausalLM, build_model
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.errors import CheckpointError
from specserve.models.layers import WeightShapeError
from specserve.models.moe import ExpertsFn, StackedExperts, moe_reference

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (one file, or the shards an index names)."""
    single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read shard index {index}: {e!r}") from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(missing)}")
        return files
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    parallel: ParallelConfig | None = None,
    experts_fn: ExpertsFn = moe_reference,
    progress: bool = True,
) -> tuple[CausalLM, ModelConfig]:
    path = os.fspath(path)
    config = ModelConfig.from_file(path)
    files = checkpoint_files(path)
    with torch.device(device), _default_dtype(dtype):
        model = build_model(config, parallel, experts_fn)
    load_weights(model, files, progress)
    return model.eval(), config


def load_weights(model: CausalLM, files: list[str], progress: bool = True) -> None:
    """Stream every tensor into its parameter; a quantized Linear (config.quantization) arrives as one
    lazy dequantizing tensor (quant_sources.open_tensor), its scales possibly in another shard."""
    config = model.config
    quant, prefix = config.quantization, config.checkpoint_prefix
    params = dict(model.named_parameters())
    local = {
        f"{name}.{p}": module.local_experts()
        for name, module in model.named_modules()
        if isinstance(module, StackedExperts)
        for p in ("w13", "w2")
    }
    needed = {  # a parameter `loaded_with` another (int4 experts' scales) has no checkpoint tensor of its own
        name: weight_names.required_pieces(name, local.get(name))
        for name, p in params.items()
        if not hasattr(p, "loaded_with")
    }
    num_experts = config.moe.num_experts if config.moe else 0
    with contextlib.ExitStack() as stack:
        handles, names_of = {}, {}  # stored name -> open file (every shard: scales may sit elsewhere)
        for file in files:
            try:
                handle = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises its own error types for bad headers / short files
                raise CheckpointError(f"corrupt or unreadable safetensors file {file}: {e}") from e
            names_of[file] = list(handle.keys())
            handles.update(dict.fromkeys(names_of[file], handle))
        # disable=None: no bar when stderr is not a terminal (a log file, or `specserve serve`'s pipe)
        bar = tqdm(
            files, desc="loading checkpoint shards", unit="file", file=sys.stderr, disable=None if progress else True
        )
        for file in bar:
            for stored in names_of[file]:
                if not stored.startswith(prefix) or quant_sources.is_companion(stored, quant):
                    continue  # a multimodal wrapper's vision tower; scales are read with their weight
                try:
                    name, tensor = quant_sources.open_tensor(stored, handles, quant)
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {stored} from {file} (corrupt file?): {e}") from e
                name = name[len(prefix) :]
                target = weight_names.resolve(name, config.num_layers, config.tie_word_embeddings, num_experts)
                if target is None:
                    continue
                param = params.get(target.param)
                if param is None:
                    raise CheckpointError(
                        f"unexpected tensor {stored} in {file}: the model has no parameter {target.param}"
                    )
                try:
                    param.weight_loader(param, tensor, **target.kwargs)  # reads (its part of) the tensor
                except WeightShapeError as e:
                    raise CheckpointError(f"tensor {stored} in {file} does not fit {target.param}: {e}") from e
                except Exception as e:
                    raise CheckpointError(f"cannot read tensor {stored} from {file} (corrupt file?): {e}") from e
                needed[target.param].difference_update(target.pieces)
                del tensor
    missing = [
        weight_names.checkpoint_name(p, piece) for p, pieces in needed.items() for piece in sorted(pieces, key=str)
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint {', '.join(files)} lacks tensor(s): {shown}")


def load_tokenizer(path: str | os.PathLike[str]):  # -> tokenizers.Tokenizer | None
    """The checkpoint's tokenizer.json as a `tokenizers.Tokenizer`, or None when there is none."""
    from tokenizers import Tokenizer

    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise CheckpointError(f"cannot read tokenizer {file}: {e}") from e
