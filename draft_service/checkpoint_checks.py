"""Checkpoint helpers of the drafter factories: a checkpoint's vocabulary, the target's name / vocabulary / config,
and the check that a drafter's vocabulary is the target's; every failure is a DrafterConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from specserve.draft_service.drafter_errors import DrafterConfigError, VocabMismatchError
from specserve.models.errors import ModelConfigError

T = TypeVar("T")


def checkpoint_vocab(checkpoint_dir: Path) -> tuple[int, str]:
    """(vocab_size from config.json, vocab_hash) of a checkpoint dir; errors become DrafterConfigError."""
    from specserve.models.vocab import config_vocab_size, vocab_hash

    try:
        return config_vocab_size(checkpoint_dir), vocab_hash(checkpoint_dir)
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the vocabulary of {checkpoint_dir}: {e}") from e


def target_name(target: Path):
    """The target's ModelName (models/model_names.py: a checkpoint folder or a demo@ / synthetic name); a bad one is a
    DrafterConfigError."""
    from specserve.models.model_names import resolve_model

    try:
        return resolve_model(target)
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"target {target}: {e}") from e


def target_vocab(target: Path):
    """The target's Vocabulary (models/model_names.py: a checkpoint folder or a demo@ / synthetic name); errors
    become DrafterConfigError."""
    try:
        return target_name(target).vocabulary()
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the vocabulary of the target {target}: {e}") from e


def target_config(target: Path):
    """The target's ModelConfig (a checkpoint folder or a demo@ / synthetic name); errors become DrafterConfigError."""
    try:
        return target_name(target).config()
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot read the config of the target {target}: {e}") from e


def check_same_vocab(draft_dir: Path, target: Path) -> tuple[int, str]:
    """Refuse a drafter whose vocabulary differs from the target's; returns the target's (size, hash). Without two
    tokenizer fingerprints the drafter's size must be the number of ids the target can emit (a demo@ target: the
    demo's, its padded rows masked)."""
    from specserve.models.vocab import vocab_matches

    d_size, d_hash = checkpoint_vocab(draft_dir)
    t = target_vocab(target)
    if not vocab_matches(d_hash, d_size, t.hash, t.limit):
        raise VocabMismatchError(
            f"drafter vocabulary ({d_hash}, vocab_size {d_size}) at {draft_dir} does not match the"
            f" target's ({t.hash}, vocab_size {t.limit}) at {target}"
        )
    return t.size, t.hash


def scaled_drafter(build: Callable[[], T]) -> T:
    """build(): the demo's drafter scaled to a demo@ target (models/scaled_drafters.py, scaled_mtp.py); a drafter that
    does not scale (ModelConfigError) is a DrafterConfigError."""
    try:
        return build()
    except ModelConfigError as e:
        raise DrafterConfigError(str(e)) from e
