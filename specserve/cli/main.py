"""The `specserve` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their subcommand runs, so ``specserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import sys
from types import MappingProxyType
from typing import NoReturn

# subcommand -> (module, one-line help)
SUBCOMMANDS = MappingProxyType(
    {
        "generate": ("specserve.cli.generate", "generate in one process (target + draft embedded)"),
        "demo": ("specserve.cli.demo", "run the shipped demo through gateway, draft and target"),
        "serve": ("specserve.cli.serve", "start target, draft and gateway as three local processes"),
        "target": ("specserve.cli.target_cmd", "start the target service"),
        "draft": ("specserve.cli.draft_cmd", "start a draft service"),
        "gateway": ("specserve.cli.gateway_cmd", "start the gateway"),
        "client": ("specserve.cli.client", "call a running gateway"),
        "bench": (
            "specserve.cli.bench_cmd",
            "the benchmarks: e2e (the default), step, kernels, draft, overhead, project",
        ),
        "train": ("specserve.cli.train_cmd", "train the demo tokenizer, target and drafters"),
    }
)

# Errors that are the user's (bad flags, bad checkpoint, bad input): one line, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def _available() -> dict[str, str]:
    """Subcommands whose module exists in this checkout (absent ones are not offered)."""
    found = {}
    for name, (module, _) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = module
    return found


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default: appended to its help (unless the help already says it), and as the
    help of a flag that has none. Flags whose default is unset (None) or off (False) say nothing more."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"

    def _format_action(self, action):
        if not action.help and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line, not the whole usage:
    ``specserve generate: error: --draft: invalid choice: 'foo' (...) (see --help)``, exit code 2; an
    unknown flag is named before any missing one; --help shows defaults. Subparsers (``specserve train
    target``) are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self.given: list[str] = []  # the command line this parser reads (to name an unknown flag first)

    def _unknown_flags(self) -> list[str]:
        known = self._option_string_actions
        out = []
        for token in self.given:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known and not any(k.startswith(name) for k in known):
                out.append(name)
        return out

    def error(self, message: str) -> NoReturn:
        unknown = self._unknown_flags() if "required" in message else []
        if unknown:  # "--prompt is required" hides the typo that caused it
            message = f"unrecognized arguments: {' '.join(unknown)}"
        match = re.fullmatch(r"argument ([^:]+): (.*)", message, flags=re.DOTALL)
        if match:  # "argument --draft: invalid choice ..." -> "--draft: invalid choice ..."
            message = f"{match.group(1)}: {match.group(2)}"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(argv: list[str], modules: dict[str, str] | None = None) -> tuple[argparse.ArgumentParser, object]:
    """(the `specserve` parser, the chosen subcommand's module or None); only the subcommand that argv
    names gets its flags (its module imported), so other subcommands cost nothing."""
    modules = _available() if modules is None else modules
    parser = OneLineParser(prog="specserve", description="Lossless speculative decoding for MoE LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in modules else None
    mod = None
    for name, module in modules.items():
        p = sub.add_parser(name, help=SUBCOMMANDS[name][1], description=SUBCOMMANDS[name][1])
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.given = list(argv[1:])
    return parser, mod


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, mod = build_parser(argv)
    args = parser.parse_args(argv)
    from specserve.errors import SpecserveError

    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (SpecserveError, *USER_ERRORS) as exc:
        print(f"specserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
