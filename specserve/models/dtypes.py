"""The one table of dtype names the command line, configs and checkpoints use."""

from __future__ import annotations

from types import MappingProxyType

import torch

DTYPES = MappingProxyType(
    {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
)
ENGINE_DTYPES = ("float32", "bfloat16")  # what the target engine serves in
