"""Every `specserve ...` example in README.md's code blocks parses with the CLI's own parser (a renamed or
removed flag fails here before a reader trips over it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from specserve.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^```\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            elided = re.search(r"(^|\s)\.\.\.(\s|$)", line)  # a bare ... stands for flags shown above it
            if argv[:1] == ["specserve"] and not elided:
                commands.append(argv[1:])
    return commands


def test_every_readme_example_parses():
    commands = readme_commands()
    assert len(commands) >= 15 and {c[0] for c in commands} >= {"generate", "serve", "client", "target", "draft",
                                                                 "gateway", "train"}
    for argv in commands:
        parser, mod = build_parser(argv)
        assert mod is not None, argv
        args = parser.parse_args(argv)  # an unknown flag or bad value exits 2 here, naming it
        assert args.command == argv[0]
