"""The training corpus: the Python standard library source of the interpreter that runs the command.

Files are ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path, skipping the
``test``/``tests`` packages and ``site-packages``. The splits are by file and do not depend on the file
list: with ``r = crc32(relative_path) % MODULUS`` a file is held out when r == 0 (about one file in 20;
only for the final report and the acceptance prompts), used for validation (early stopping) when r == 1,
and trained on otherwise, so the same module names are held out on every interpreter version.
"""

from __future__ import annotations

import re
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from specserve.errors import SpecserveError

MODULUS = 20
SKIP_DIRS = frozenset({"test", "tests", "site-packages", "__pycache__", "idle_test"})


class CorpusError(SpecserveError):
    """The corpus cannot be built (missing stdlib folder, empty selection, ...)."""


@dataclass(frozen=True)
class CorpusSpec:
    root: Path | None = None  # default: this interpreter's stdlib folder
    max_files: int | None = None  # keep only the first N files of each split (tests, smoke runs)
    max_chars_per_file: int | None = None  # truncate each file (tests)

    def __post_init__(self) -> None:
        if self.max_files is not None and self.max_files < 1:
            raise CorpusError(f"max_files must be >= 1, got {self.max_files}")
        if self.max_chars_per_file is not None and self.max_chars_per_file < 1:
            raise CorpusError(f"max_chars_per_file must be >= 1, got {self.max_chars_per_file}")


@dataclass(frozen=True)
class Corpus:
    root: Path
    python_version: str
    train_files: tuple[str, ...]  # relative paths, sorted
    valid_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    spec: CorpusSpec

    def read(self, rel: str) -> str:
        text = (self.root / rel).read_text(encoding="utf-8", errors="replace")
        if self.spec.max_chars_per_file is not None:
            text = text[: self.spec.max_chars_per_file]
        return text

    def texts(self, split: str) -> list[str]:
        files = {"train": self.train_files, "valid": self.valid_files, "heldout": self.heldout_files}.get(split)
        if files is None:
            raise CorpusError(f"split must be 'train', 'valid' or 'heldout', got {split!r}")
        return [self.read(rel) for rel in files]


def split_of(rel_path: str) -> str:
    r = zlib.crc32(rel_path.encode("utf-8")) % MODULUS
    return "heldout" if r == 0 else "valid" if r == 1 else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path) -> list[str]:
    """Sorted relative paths (POSIX separators) of the corpus files under ``root``."""
    if not root.is_dir():
        raise CorpusError(f"corpus folder {root} does not exist")
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if path.is_file():
            out.append(rel.as_posix())
    out.sort()
    if not out:
        raise CorpusError(f"no *.py files under {root}")
    return out


def load_corpus(spec: CorpusSpec = CorpusSpec()) -> Corpus:
    root = spec.root if spec.root is not None else stdlib_root()
    files = list_files(root)
    parts = {name: [f for f in files if split_of(f) == name] for name in ("train", "valid", "heldout")}
    if spec.max_files is not None:
        parts = {name: fs[: spec.max_files] for name, fs in parts.items()}
    empty = [name for name, fs in parts.items() if not fs]
    if empty:
        raise CorpusError(f"split of {len(files)} files under {root} left empty part(s): {empty}")
    version = "%d.%d.%d" % sys.version_info[:3]
    return Corpus(root, version, tuple(parts["train"]), tuple(parts["valid"]), tuple(parts["heldout"]), spec)


_DEF_LINE = re.compile(r"^(?:    )?(?:def |class |async def )", re.MULTILINE)


def prompt_snippets(texts: list[str], count: int, min_chars: int = 200, max_chars: int = 600) -> list[str]:
    """Deterministic code prompts: each ends right after a ``def``/``class`` header line of a file, and
    starts at a line boundary at most ``max_chars`` before that (one prompt per file, files in order,
    at the middle header of the file)."""
    prompts = []
    for text in texts:
        heads = [m.start() for m in _DEF_LINE.finditer(text)]
        heads = [h for h in heads if h >= min_chars]
        if not heads:
            continue
        start_of_header = heads[len(heads) // 2]
        end = text.find("\n", start_of_header)
        if end < 0:
            continue
        end += 1  # include the header's newline: the model continues with the body
        begin = text.rfind("\n", 0, max(0, end - max_chars))
        begin = 0 if begin < 0 else begin + 1
        prompts.append(text[begin:end])
        if len(prompts) == count:
            break
    return prompts
