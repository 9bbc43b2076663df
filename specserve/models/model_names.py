"""What a model name (`--model`, `EngineConfig.model`, `DrafterConfig.target_checkpoint`) means: the one place that
turns it into a config, a vocabulary, a tokenizer folder and the shipped drafters that fit it.

A name is one of

- a checkpoint folder: its config.json, its tokenizer.json;
- `demo@NAME[:LAYERS]` (models/scaled_demo.py): the shipped demo target embedded in a published shape. Its config
  is the wide one (`scaled_config`), its tokenizer the demo's, its wire vocabulary the wide one (163840 for the
  published shapes) of which only the demo's ids can be emitted (`logits_vocab_limit`); the shipped demo drafters
  fit it (scaled to its shape: EAGLE-3, the draft LM, DFlash, MTP);
- `synthetic:NAME[:LAYERS]` (models/presets.py): random weights, no tokenizer, a size-only vocabulary.

Services and the CLI ask `resolve_model(name)`; nothing else parses the prefixes for these questions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specserve.models.config import ModelConfig
from specserve.models.errors import ModelConfigError


@dataclass(frozen=True)
class Vocabulary:
    """A model's vocabulary as a drafter is matched against it."""

    size: int  # the logits' width (the engine's vocab_size, what the wire carries)
    hash: str  # the models/vocab.py fingerprint ("sha256:..." with a tokenizer, else "size:<size>")
    limit: int  # ids the model can emit: size, or fewer where the padded rows are masked (a demo@ model: the demo's)


@dataclass(frozen=True)
class ModelName:
    """A resolved model name (`resolve_model`)."""

    name: str  # as given
    folder: (
        Path | None
    )  # the checkpoint folder its weights and tokenizer come from (demo@: the demo's; synthetic: none)
    scaled: bool = False  # a demo@ name: the demo embedded in a published shape

    def config(self) -> ModelConfig:
        """The model's config (demo@: the wide one)."""
        if self.scaled:
            from specserve.models.scaled_shapes import scaled_config

            return scaled_config(self.name, ModelConfig.from_file(self.folder))
        if self.folder is None:
            from specserve.models.presets import synthetic_config

            return synthetic_config(self.name)
        return ModelConfig.from_file(self.folder)

    def demo_config(self) -> ModelConfig:
        """demo@ only: the config of the demo it embeds."""
        if not self.scaled:
            raise ModelConfigError(f"{self.name} embeds no demo model")
        return ModelConfig.from_file(self.folder)

    @property
    def tokenizer_folder(self) -> Path | None:
        """The folder whose tokenizer.json (and chat template) the model uses, or None (synthetic)."""
        return self.folder

    def vocabulary(self) -> Vocabulary:
        from specserve.models.vocab import config_vocab_size, vocab_hash

        if not self.scaled and self.folder is not None:  # config.json's vocab_size alone (any model_type)
            size = config_vocab_size(self.folder)
            return Vocabulary(size, vocab_hash(self.folder), size)
        config = self.config()
        tok = self.tokenizer_folder
        if tok is not None and (tok / "tokenizer.json").is_file():
            digest = vocab_hash(tok)
        else:
            digest = f"size:{config.vocab_size}"
        return Vocabulary(config.vocab_size, digest, config.logits_vocab_limit or config.vocab_size)

    @property
    def ships_demo_drafters(self) -> bool:
        """The shipped demo drafters (demo_model/<family>) are this model's default drafters."""
        return self.scaled


def resolve_model(model: str | os.PathLike[str]) -> ModelName:
    """The ModelName of `model`; an unknown demo@ / synthetic name or a missing folder is a ModelConfigError."""
    from specserve.models.presets import is_synthetic, parse_spec
    from specserve.models.scaled_shapes import is_scaled_demo, parse_scaled_spec

    text = os.fspath(model)
    if is_scaled_demo(text):
        from specserve.paths import demo_checkpoint

        parse_scaled_spec(text)
        return ModelName(text, demo_checkpoint("target"), scaled=True)
    if is_synthetic(text):
        parse_spec(text)
        return ModelName(text, None)
    folder = Path(text)
    if not folder.is_dir():
        raise ModelConfigError(f"model folder {text} does not exist")
    return ModelName(text, folder)
