"""`specserve demo`: the shipped demo model through real gateway, draft and target processes.

Starts `specserve serve` (three processes), sends one completion request with `specserve client`,
prints the completion, tokens/s and mean accepted length, then stops the services.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

DEMO_PROMPT = "def read_config(path):\n    "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", default="model", choices=("none", "ngram", "model", "eagle3", "dflash", "dspark"))
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--port", type=int, default=50071)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the services")


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"`specserve serve` exited with {proc.returncode} before it was ready")
        if needle in line:
            return line.strip()
    raise TimeoutError(f"`specserve serve` did not print {needle!r} within {timeout:.0f} s")


def run(args: argparse.Namespace) -> int:
    from specserve.paths import demo_checkpoint

    demo_checkpoint("target")  # a clear error when the shipped model is missing
    exe = [sys.executable, "-m", "specserve.cli.main"]
    serve = subprocess.Popen(
        [*exe, "serve", "--draft", args.draft, "--port", str(args.port), "--device", args.device],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ready = _wait_for_line(serve, "gateway listening on", args.timeout)
        print(ready, file=sys.stderr)
        client = subprocess.run(
            [
                *exe,
                "client",
                "--gateway",
                f"127.0.0.1:{args.port}",
                "--prompt",
                args.prompt,
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if client.returncode != 0:
            print(client.stderr.strip(), file=sys.stderr)
            return client.returncode
        out = json.loads(client.stdout)
        print(args.prompt + out.get("text", ""))
        stats = out["stats"]
        print(
            f"\n[draft {args.draft}: {len(out['token_ids'])} tokens, {stats['tokens_per_s']:.1f} tokens/s, "
            f"mean accepted length {stats['mean_accepted_length']:.2f}, finish {out['finish_reason']}]"
        )
        return 0
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
