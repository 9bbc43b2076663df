"""Target model code: configs, layers, the shared CausalLM, and the checkpoint loader."""

from specserve.target_service.models.causal_lm import CausalLM, ModelInputError, ModelOutput, build_model
from specserve.target_service.models.config import (
    SUPPORTED_MODEL_TYPES,
    GQAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RopeConfig,
)
from specserve.target_service.models.errors import CheckpointError, ModelConfigError, UnsupportedModelError
from specserve.target_service.models.loader import load_model, load_tokenizer

__all__ = [
    "CausalLM",
    "CheckpointError",
    "GQAConfig",
    "MLAConfig",
    "ModelConfig",
    "ModelConfigError",
    "ModelInputError",
    "ModelOutput",
    "MoEConfig",
    "ParallelConfig",
    "RopeConfig",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "build_model",
    "load_model",
    "load_tokenizer",
]
