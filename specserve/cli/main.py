"""The `specserve` command: one entry point, one module per subcommand.

Each subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their subcommand runs, so ``specserve --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import MappingProxyType

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
        "bench": ("specserve.cli.bench_cmd", "run the reproducible benchmark"),
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modules = _available()
    parser = argparse.ArgumentParser(prog="specserve", description="Lossless speculative decoding for MoE LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv and argv[0] in modules else None
    mod = None
    for name, module in modules.items():
        p = sub.add_parser(name, help=SUBCOMMANDS[name][1], description=SUBCOMMANDS[name][1])
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
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
