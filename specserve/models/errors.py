"""Errors raised while reading a model's config or checkpoint."""

from __future__ import annotations

from specserve.errors import SpecserveError


class ModelConfigError(ValueError):
    """config.json is missing a field or holds an invalid / unsupported value."""


class UnsupportedModelError(ModelConfigError):
    """config.json names a model_type this server does not implement."""

    def __init__(self, model_type: object, supported: tuple[str, ...]) -> None:
        self.model_type = model_type
        self.supported = supported
        super().__init__(f"unsupported model_type {model_type!r}; supported: {', '.join(supported)}")


class CheckpointError(SpecserveError, RuntimeError):
    """A checkpoint file is missing, corrupt, or holds a tensor that does not fit the model (a user error:
    the CLI prints it as one line naming the file)."""
