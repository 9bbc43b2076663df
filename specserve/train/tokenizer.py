"""Byte-level BPE tokenizer for the demo (Hugging Face ``tokenizers``), saved as ``tokenizer.json``.

Token id 0 is ``<|endoftext|>``: the document separator in training streams, the BOS and the EOS of
the demo models. The training is deterministic for a given corpus (BPE merges are ranked by count and
ties broken by the library's fixed order; the library takes no seed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specserve.errors import SpecserveError

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0


class TokenizerError(SpecserveError):
    """The tokenizer cannot be trained or loaded."""


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int = 4096
    min_frequency: int = 2

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + 1:
            raise TokenizerError(f"vocab_size must be > 256 (the byte alphabet + EOS), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise TokenizerError(f"min_frequency must be >= 1, got {self.min_frequency}")


def train_tokenizer(texts: list[str], spec: TokenizerSpec = TokenizerSpec()) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS_TOKEN) != EOS_ID:
        raise TokenizerError(f"{EOS_TOKEN} got id {tok.token_to_id(EOS_TOKEN)}, expected {EOS_ID}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """tokenizer.json plus the small tokenizer_config.json that transformers' AutoTokenizer reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    """``path`` is a tokenizer.json or a folder holding one."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise TokenizerError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))
