"""Command lines live in cli/ and tools/ (issue #45): no other module of the package imports argparse or adds a
flag, so a library module is called with a config, never with a parsed command line."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specserve", "gateway", "draft_service", "target_service", "kernels", "protos")
HOMES = (ROOT / "specserve" / "cli", ROOT / "specserve" / "tools")
FLAGS = re.compile(r"^\s*(import argparse|from argparse import)|\.add_argument\(", re.MULTILINE)


def test_argparse_only_in_cli_and_tools():
    found = sorted(
        str(f.relative_to(ROOT))
        for package in PACKAGES
        for f in (ROOT / package).rglob("*.py")
        if not any(home in f.parents for home in HOMES) and FLAGS.search(f.read_text(encoding="utf-8"))
    )
    assert found == [], f"argparse outside cli/ and tools/: {found}"
