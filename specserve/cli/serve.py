"""`specserve serve`: target, draft and gateway as three local processes, wired by Unix sockets.

Prints exactly one line on stdout, ``gateway listening on HOST:PORT``, once the gateway accepts
requests (with ``--http-port``, ``gateway http listening on http://HOST:PORT`` just before it); the services' own
output goes to stderr, each line prefixed with its role. SIGINT/SIGTERM stop all three. A draft process that dies
is not fatal (requests go on target-only); a target or gateway that dies stops the rest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specserve.cli.common import add_model_arguments, check_target_placement, split_threads, usable_cores
from specserve.cli.service_flags import add_http_limit_arguments, add_request_limit_arguments, http_limit_argv
from specserve.contract.speculation import DEFAULT_MAX_BLOCK_SIZE
from specserve.errors import SpecserveError
from specserve.progress import EVERY_S, Heartbeat

READY = "gateway listening on "
HTTP_READY = "gateway http listening on "  # gateway_cmd.HTTP_READY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="gateway host")
    parser.add_argument("--port", type=int, default=50051, help="gateway port (0 = any free port)")
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="gateway's OpenAI-compatible HTTP API and /metrics port (0 = any free port; default: off); "
        "its /metrics also relays the target's and draft's state",
    )
    parser.add_argument(
        "--target-metrics-port",
        type=int,
        default=None,
        help="the target's own GET /metrics on 127.0.0.1 at this port (0 = any; default: off)",
    )
    parser.add_argument(
        "--draft-metrics-port",
        type=int,
        default=None,
        help="the draft's own GET /metrics on 127.0.0.1 at this port (0 = any; default: off)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in responses and the HTTP API (default: the checkpoint folder name)",
    )
    add_http_limit_arguments(parser)
    parser.add_argument(
        "--max-block-size", type=int, default=DEFAULT_MAX_BLOCK_SIZE, help="most tokens one proposal may draft"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="cores to share between the three processes (0: those this process may use): the "
        "gateway 1, an n-gram draft 1, a model draft a quarter, the target the rest",
    )
    limits = parser.add_argument_group("limits (the gateway's; sessions and queue also the target's)")
    add_request_limit_arguments(limits)
    parser.add_argument("--draft-step-timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--trust-draft-probs",
        action="store_true",
        help="verify with the drafter's probabilities q (default: proposal-only, see docs/operations.md)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--grace-s", type=float, default=10.0, help="seconds in-flight requests get on stop")
    parser.add_argument(
        "--progress-every-s",
        type=float,
        default=EVERY_S,
        help="seconds between two 'waiting for ...' lines while the services start",
    )
    parser.add_argument(
        "--no-shm",
        action="store_true",
        help="every step over gRPC: no shared-memory data plane between the three (also SPECSERVE_SHM=0)",
    )
    parser.add_argument(
        "--no-hidden-share",
        action="store_true",
        help="EAGLE-3 / DFlash hidden rows as bytes in the messages, never a buffer the drafter maps "
        "(also SPECSERVE_HIDDEN_SHARE=0)",
    )
    parser.add_argument(
        "--graph-hidden-layers",
        default=None,
        help="passed to the target: layers whose hidden rows the drafter reads (EAGLE-3, DFlash), so "
        "its steps replay CUDA graphs too",
    )
    from specserve.cli.service_flags import add_tls_arguments

    add_tls_arguments(parser)  # the gateway's public port (the inner hops are unix sockets in a private folder)
    parser.add_argument(
        "--auth-token", default=None, help="bearer token the gateway requires (default: $SPECSERVE_AUTH_TOKEN)"
    )
    parser.add_argument(
        "--admin-token",
        default=None,
        help="allow SetDraft (`specserve client --set-draft`) for calls carrying this token, as the "
        "gateway's --admin-token (default: $SPECSERVE_ADMIN_TOKEN; unset: SetDraft off)",
    )


class _Children:
    """The started processes, stopped in reverse dependency order (gateway, draft, target).

    Each child's stdout and stderr come back through pipes and go out on this process's stderr one
    whole line at a time, prefixed with the child's role (``[draft] draft (ngram) listening on ...``), so
    three services never interleave mid-line. Piped, the children see no terminal and draw no progress bars.
    """

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self._write = threading.Lock()  # one line at a time on stderr
        self._readers: list[threading.Thread] = []

    def start(self, role: str, argv: list[str], on_stdout=None, extra_env=None) -> subprocess.Popen:
        """Start ``specserve ROLE argv``; on_stdout(line) -> True keeps a stdout line from being forwarded."""
        base = os.environ.get("OTEL_SERVICE_NAME") or "specserve"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_SERVICE_NAME": f"{base}-{role}", **(extra_env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli.main", role, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,  # universal newlines: a stray carriage return ends a line too
        )
        self.procs[role] = proc
        for stream, keep in ((proc.stdout, on_stdout), (proc.stderr, None)):
            reader = threading.Thread(target=self._forward, args=(role, stream, keep), daemon=True)
            reader.start()
            self._readers.append(reader)
        return proc

    def say(self, line: str) -> None:
        """A line of serve's own on stderr (never inside a child's line)."""
        with self._write:
            print(line, file=sys.stderr, flush=True)

    def _forward(self, role: str, stream, keep) -> None:
        for line in stream:
            if keep is not None and keep(line):
                continue
            self.say(f"[{role}] {line.rstrip()}")

    def dead(self) -> list[str]:
        return [r for r, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace_s: float) -> None:
        for role in ("gateway", "draft", "target"):
            proc = self.procs.get(role)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s + 5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for reader in self._readers:  # the children's last lines ("target stopped") reach stderr
            reader.join(timeout=5)


class _Stopped(Exception):
    """SIGINT/SIGTERM arrived while the services were starting."""


def _wait_healthy(
    address: str, deadline: float, children: _Children, stop: threading.Event, role: str, heartbeat: Heartbeat
) -> None:
    from specserve.runtime.healthcheck import wait_serving

    def check_abort() -> None:
        if stop.is_set():
            raise _Stopped
        heartbeat.beat(f"specserve serve: waiting for the {role} to load its model and listen")
        dead = children.dead()
        if dead:
            raise SpecserveError(f"the {dead[0]} process exited with {children.procs[dead[0]].returncode} at start")

    try:
        wait_serving(address, deadline, check_abort)
    except TimeoutError as exc:
        raise SpecserveError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from specserve.cli.common import drafter_config_from_args, model_name

    model = Path(model_name(args.model).name)  # a folder or a demo@ / synthetic name (one line if neither)
    dtype = check_target_placement(args.device, args.dtype)  # the target's refusals now, not in a child
    from specserve.gateway.validation import RequestLimits
    from specserve.runtime.admission import AdmissionConfig

    try:  # the gateway's limit errors now, not in a child
        AdmissionConfig(args.max_sessions, args.max_queued)
        RequestLimits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_output_tokens)
    except ValueError as exc:
        raise SpecserveError(f"limits (--max-sessions, --max-queued, --max-prompt-tokens): {exc}") from None
    if args.draft != "none":
        drafter_config_from_args(args, target_checkpoint=model)  # flag errors now, not in a child
    for flag, port in (
        ("--port", args.port),
        ("--http-port", args.http_port),
        ("--target-metrics-port", args.target_metrics_port),
        ("--draft-metrics-port", args.draft_metrics_port),
    ):
        if port is not None and not 0 <= port <= 65535:
            raise SpecserveError(f"{flag} must be in [0, 65535], got {port}")
    if args.threads < 0:
        raise SpecserveError(f"--threads must be >= 0, got {args.threads}")
    from specserve.runtime.servers_common import check_free  # the flags' errors first, then the host's ports

    check_free(
        [f"{args.host}:{p}" for p in (args.port, args.http_port) if p is not None]
        + [f"127.0.0.1:{p}" for p in (args.target_metrics_port, args.draft_metrics_port) if p is not None]
    )

    threads = split_threads(args.threads or usable_cores(), args.draft)  # target, draft, gateway

    def pool(n: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sockets = tempfile.mkdtemp(prefix="specserve-")
    target_addr, draft_addr = f"unix:{sockets}/target.sock", f"unix:{sockets}/draft.sock"
    children = _Children()
    model_flag = ["--model", str(args.model)] if args.model is not None else []
    placement = ["--device", args.device, "--dtype", dtype]
    no_shm = (["--no-shm"] if args.no_shm else []) + (["--no-hidden-share"] if args.no_hidden_share else [])
    try:
        children.start(
            "target",
            [
                *model_flag,
                *placement,
                "--listen",
                target_addr,
                "--tensor-parallel-size",
                str(args.tensor_parallel_size),
                "--num-kv-blocks",
                str(args.num_kv_blocks),
                "--kv-block-size",
                str(args.kv_block_size),
                "--invariant-steps",
                args.invariant_steps,
                *(["--enable-expert-parallel"] if args.enable_expert_parallel else []),
                "--grace-s",
                str(args.grace_s),
                *no_shm,
                "--max-sessions",
                str(args.max_sessions),
                "--max-queued",
                str(args.max_queued),
                *(["--graph-hidden-layers", args.graph_hidden_layers] if args.graph_hidden_layers else []),
                *(["--metrics-port", str(args.target_metrics_port)] if args.target_metrics_port is not None else []),
                "--threads",
                str(threads[0]),
            ],
            extra_env=pool(threads[0]),
        )
        gateway_drafts: list[str] = []
        if args.draft != "none":
            children.start(
                "draft",
                [
                    "--draft",
                    args.draft,
                    *model_flag,
                    *placement,
                    "--listen",
                    draft_addr,
                    "--max-block-size",
                    str(args.max_block_size),
                    "--grace-s",
                    str(args.grace_s),
                    *no_shm,
                    *(["--draft-model", str(args.draft_model)] if args.draft_model is not None else []),
                    *(["--denoise-steps", str(args.denoise_steps)] if args.denoise_steps is not None else []),
                    *(["--metrics-port", str(args.draft_metrics_port)] if args.draft_metrics_port is not None else []),
                    "--threads",
                    str(threads[1]),
                ],
                extra_env=pool(threads[1]),
            )
            gateway_drafts = ["--draft-service", f"{args.draft}={draft_addr}"]
            if args.trust_draft_probs:
                gateway_drafts += ["--trust-draft-probs", args.draft]
        ready: list[str] = []
        seen = threading.Event()

        def ready_line(line: str) -> bool:
            """The gateway's ready lines (HTTP, then gRPC) are kept for our stdout, not forwarded."""
            if not seen.is_set() and line.startswith((READY, HTTP_READY)):
                ready.append(line.strip())
                if line.startswith(READY):
                    seen.set()
                return True
            return False

        children.start(
            "gateway",
            [
                "--target",
                target_addr,
                *gateway_drafts,
                "--model",
                str(model),
                "--host",
                args.host,
                "--port",
                str(args.port),
                *(["--http-port", str(args.http_port), *http_limit_argv(args)] if args.http_port is not None else []),
                *(["--served-model-name", args.served_model_name] if args.served_model_name is not None else []),
                "--draft-step-timeout-s",
                str(args.draft_step_timeout_s),
                "--grace-s",
                str(args.grace_s),
                *no_shm,
                "--max-sessions",
                str(args.max_sessions),
                "--max-queued",
                str(args.max_queued),
                "--max-prompt-tokens",
                str(args.max_prompt_tokens),
                "--max-output-tokens",
                str(args.max_output_tokens),
                "--threads",
                str(threads[2]),
                *[
                    a
                    for flag in ("cert", "key", "ca")
                    if getattr(args, f"tls_{flag}") is not None
                    for a in (f"--tls-{flag}", str(getattr(args, f"tls_{flag}")))
                ],
            ],
            on_stdout=ready_line,  # the token goes by environment, never on a command line
            extra_env={
                **pool(threads[2]),
                **({"SPECSERVE_AUTH_TOKEN": args.auth_token} if args.auth_token else {}),
                **({"SPECSERVE_ADMIN_TOKEN": args.admin_token} if args.admin_token else {}),
            },
        )
        deadline = time.monotonic() + args.startup_timeout_s
        heartbeat = Heartbeat(children.say, args.progress_every_s)  # a line every few s: starting may take a while
        _wait_healthy(target_addr, deadline, children, stop, "target", heartbeat)
        if args.draft != "none":
            _wait_healthy(draft_addr, deadline, children, stop, "draft", heartbeat)
        while not seen.wait(0.1):
            heartbeat.beat("specserve serve: waiting for the gateway")
            if stop.is_set():
                raise _Stopped
            dead = children.dead()
            if dead:
                raise SpecserveError(f"the {dead[0]} process exited with {children.procs[dead[0]].returncode} at start")
            if time.monotonic() > deadline:
                raise SpecserveError("the gateway did not become ready in time")
        for line in ready:
            print(line, flush=True)
        reported: set[str] = set()
        while not stop.wait(0.2):
            dead = set(children.dead()) - reported
            if "target" in dead or "gateway" in dead:
                role = "target" if "target" in dead else "gateway"
                children.say(
                    f"specserve serve: the {role} process exited with {children.procs[role].returncode}; stopping"
                )
                return 1
            for role in dead:
                children.say(
                    f"specserve serve: the {role} process exited with {children.procs[role].returncode}; "
                    "going on target-only"
                )
                reported.add(role)
        return 0
    except _Stopped:
        return 0
    finally:
        children.stop(args.grace_s)
        shutil.rmtree(sockets, ignore_errors=True)
