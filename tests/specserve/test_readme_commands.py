"""Every `specserve ...` example in README.md's and docs/'s code blocks parses with the CLI's own parser (a renamed or
removed flag fails here before a reader trips over it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from specserve.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))  # the README and the pages it sends readers to


def readme_commands(paths=DOCS) -> list[list[str]]:
    blocks = [
        b
        for p in paths  # each file on its own: a fence never pairs across two files
        for b in re.findall(r"^```\n(.*?)^```", p.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    ]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            elided = re.search(r"(^|\s)\.\.\.(\s|$)", line)  # a bare ... stands for flags shown above it
            if argv[:1] == ["specserve"] and not elided:
                commands.append(argv[1:])
    return commands


def test_every_readme_example_parses():
    commands = readme_commands()
    assert len(commands) >= 15 and {c[0] for c in commands} >= {
        "generate",
        "serve",
        "client",
        "target",
        "draft",
        "gateway",
        "train",
    }
    for argv in commands:
        parser, mod = build_parser(argv)
        assert mod is not None, argv
        args = parser.parse_args(argv)  # an unknown flag or bad value exits 2 here, naming it
        assert args.command == argv[0]


def test_the_readme_is_short_and_shows_a_served_drafter():
    """A newcomer's five minutes (issue #45: it was 463 lines): at most 150 lines, the two make commands, one
    served example with a drafter; CI runs exactly its test command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text
    served = readme_commands([ROOT / "README.md"])
    assert ["serve", "--draft", "model", "--port", "50051"] in served
    assert any(c[0] == "client" and "--draft" in c for c in served)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"
    for page in DOCS[1:]:
        assert f"docs/{page.name}" in text, f"README does not link {page.name}"
