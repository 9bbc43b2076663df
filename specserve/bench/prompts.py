"""The pinned benchmark prompt set (specserve/bench/prompts/*.json), loaded and fingerprinted."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import SpecserveError

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
DEFAULT_SET = "v1"


class PromptSetError(SpecserveError):
    """The prompt set file is missing, malformed, or too small for the request."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    kind: str  # "code" | "prose"
    text: str

    def __post_init__(self) -> None:
        if not self.id or not self.text:
            raise PromptSetError("every prompt needs a non-empty id and text")


@dataclass(frozen=True)
class PromptSet:
    name: str
    sha256: str  # of the file bytes: results are comparable only for the same fingerprint
    prompts: tuple[BenchPrompt, ...]


def prompt_set_path(name: str = DEFAULT_SET) -> Path:
    path = Path(name)
    return path if path.suffix == ".json" else PROMPTS_DIR / f"{name}.json"


def load_prompt_set(name: str = DEFAULT_SET, limit: int | None = None) -> PromptSet:
    """The first ``limit`` prompts (all when None), interleaving kinds so a small N still mixes them."""
    path = prompt_set_path(name)
    try:
        data = path.read_bytes()
        raw = json.loads(data)
        prompts = tuple(BenchPrompt(p["id"], p["kind"], p["text"]) for p in raw["prompts"])
    except FileNotFoundError:
        raise PromptSetError(f"prompt set {path} does not exist") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise PromptSetError(f"prompt set {path} is malformed: {exc!r}") from None
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise PromptSetError(f"prompt set {path} repeats an id")
    ordered = _interleave(prompts)
    if limit is not None:
        if not 1 <= limit <= len(ordered):
            raise PromptSetError(f"--prompts must be in [1, {len(ordered)}] for {path.name}, got {limit}")
        ordered = ordered[:limit]
    return PromptSet(name=str(raw.get("name", path.stem)), sha256=hashlib.sha256(data).hexdigest(), prompts=ordered)


def _interleave(prompts: tuple[BenchPrompt, ...]) -> tuple[BenchPrompt, ...]:
    """Round-robin over kinds in first-seen order (code, prose, code, prose, ...), stable within a kind."""
    by_kind: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        by_kind.setdefault(p.kind, []).append(p)
    out: list[BenchPrompt] = []
    queues = list(by_kind.values())
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return tuple(out)
