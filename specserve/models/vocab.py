"""One vocabulary fingerprint shared by the target engine and the drafters.

``vocab_hash(checkpoint_dir)``:

- with ``tokenizer.json``: ``"sha256:<hex>"`` over the id -> token table (the tokenizer model's vocab
  plus its added tokens, sorted by id, canonical JSON). Two checkpoints with the same tokenizer agree even
  when their embedding matrices are padded to different ``vocab_size``.
- without it: ``"size:<vocab_size>"`` from config.json.

``vocab_matches(hash_a, size_a, hash_b, size_b)`` is the comparison rule: two sha256 fingerprints must
be equal; otherwise the vocab sizes must be equal.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specserve.models.errors import CheckpointError, ModelConfigError


def config_vocab_size(checkpoint_dir: str | os.PathLike[str]) -> int:
    path = Path(checkpoint_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelConfigError(f"no config.json at {path}") from e
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
    size = raw.get("vocab_size") if isinstance(raw, dict) else None
    if not isinstance(size, int) or size <= 0:
        raise ModelConfigError(f"{path} has no positive integer vocab_size (got {size!r})")
    return size


def tokenizer_table(tokenizer_json: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """[(id, token)] sorted by id: the tokenizer model's vocab plus added tokens."""
    try:
        raw = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {tokenizer_json}: {e}") from e
    table: dict[int, str] = {}
    vocab = (raw.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE / WordPiece / WordLevel: token -> id
        table.update({int(i): str(tok) for tok, i in vocab.items()})
    elif isinstance(vocab, list):  # Unigram: [[token, score], ...], id = index
        table.update({i: str(entry[0]) for i, entry in enumerate(vocab)})
    for added in raw.get("added_tokens") or ():
        table[int(added["id"])] = str(added["content"])
    if not table:
        raise CheckpointError(f"{tokenizer_json} holds no vocabulary")
    return sorted(table.items())


def vocab_hash(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Fingerprint of a checkpoint's vocabulary (see the module docstring)."""
    tok = Path(checkpoint_dir) / "tokenizer.json"
    if tok.is_file():
        blob = json.dumps(tokenizer_table(tok), ensure_ascii=False, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()
    return f"size:{config_vocab_size(checkpoint_dir)}"


def vocab_matches(hash_a: str, size_a: int, hash_b: str, size_b: int) -> bool:
    """Same vocabulary: equal tokenizer fingerprints when both have one, else equal vocab sizes."""
    if hash_a.startswith("sha256:") and hash_b.startswith("sha256:"):
        return hash_a == hash_b
    return size_a == size_b
