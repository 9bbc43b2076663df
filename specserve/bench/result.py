"""One result schema for every `specserve bench` subcommand: summary.json in --out holds

    schema_version, bench (the subcommand), command, config (its flags), environment (environment.py: versions of
    torch / CUDA / triton / flashinfer / transformers, the GPU, the git commit and a hash of the source, the copy
    bandwidth when the run measured one), then the subcommand's own results at the top level.

`SUMMARY_KEYS` and `ENVIRONMENT_KEYS` are what every summary has."""

from __future__ import annotations

import dataclasses
import gzip
import json
import sys
from collections.abc import Mapping
from pathlib import Path

SCHEMA_VERSION = 2
SUMMARY_KEYS = ("schema_version", "bench", "command", "config", "environment")
ENVIRONMENT_KEYS = ("date_utc", "versions", "specserve", "git", "device", "gpu", "bandwidth")


def jsonable(value):
    """A config value as JSON holds it: paths as text, tuples as lists, mappings and dataclasses as objects."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    return value


def make_summary(bench: str, config, environment: dict, results: Mapping) -> dict:
    """The summary of one run: the shared head, then `results` (a key of the head there is an error)."""
    clash = sorted(set(SUMMARY_KEYS) & set(results))
    if clash:
        raise ValueError(f"bench results may not carry the summary's own keys {clash}")
    head = {
        "schema_version": SCHEMA_VERSION,
        "bench": bench,
        "command": " ".join(sys.argv),
        "config": jsonable(config),
        "environment": environment,
    }
    return {**head, **results}


def write_summary(out: Path, summary: Mapping) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a bench's .jsonl artifact (steps.jsonl, requests.jsonl, ...), or of its gzipped copy: committed
    artifacts keep their large .jsonl files as .jsonl.gz (benchmarks/results/), so a reader given either name takes
    whichever is there (FileNotFoundError naming the plain path when neither is)."""
    path = Path(path)
    plain = path.with_suffix("") if path.suffix == ".gz" else path
    zipped = plain.with_name(plain.name + ".gz")
    if not plain.exists() and not zipped.exists():
        raise FileNotFoundError(f"{plain}: no such file (nor {zipped.name})")
    opener, real = (open, plain) if plain.exists() else (gzip.open, zipped)
    with opener(real, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def jsonl_exists(path: str | Path) -> bool:
    """Whether a .jsonl artifact is there, plain or gzipped (read_jsonl)."""
    plain = Path(path)
    return plain.exists() or plain.with_name(plain.name + ".gz").exists()
