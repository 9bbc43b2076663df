"""The flags every `specserve bench` subcommand shares, defined once (each takes those that apply to it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.cli.common import device_arg

DTYPES = ("float32", "bfloat16")


def add_shared_arguments(
    parser: argparse.ArgumentParser,
    *,
    out: str,
    model_help: str | None = None,
    model_type=str,
    model_default=None,
    device: str | None = "cpu",
    dtype: str | None = "float32",
    seed: bool = True,
) -> None:
    """--model, --device, --dtype, --out, --seed and --json (a None / False argument leaves its flag out)."""
    if model_help is not None:
        parser.add_argument("--model", type=model_type, default=model_default, help=model_help)
    if device is not None:
        parser.add_argument("--device", type=device_arg, default=device, help="cpu, cuda or cuda:N")
    if dtype is not None:
        parser.add_argument("--dtype", choices=DTYPES, default=dtype)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(out),
        help="artifacts folder: summary.json (one schema for every subcommand) and its own files",
    )
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and sampling")
    parser.add_argument("--json", action="store_true", help="print summary.json instead of the table")


def shard_arg(text: str) -> tuple[int, int]:
    """An argparse type: R/N, rank R of an N-way shard (N >= 2, 0 <= R < N)."""
    rank, sep, size = text.partition("/")
    if sep and rank.isdigit() and size.isdigit() and int(size) >= 2 and int(rank) < int(size):
        return int(rank), int(size)
    raise argparse.ArgumentTypeError(f"expected R/N with N >= 2 and 0 <= R < N, got {text!r}")


def name_list(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names (none empty)."""
    items = tuple(t.strip() for t in text.split(","))
    if not items or "" in items:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return items
