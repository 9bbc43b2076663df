"""Soak: target, drafts and gateway on loopback under steady load and draft kills, for a set time.

    python -m specserve.tools.soak --seconds 60        (make soak)

Starts `specserve target`, an ngram and a `model` draft service (the shipped demo drafter when it exists)
and a gateway with small admission limits, all on 127.0.0.1. Worker threads send greedy requests with
mixed drafters and lengths; every stream is checked token by token against a greedy reference made
target-only at the start, and against its final usage. Every ``--kill-every-s`` seconds one draft
service is SIGKILLed and restarted, or (every other time) frozen with SIGSTOP for ``--freeze-s`` seconds.
``--hostile-workers`` threads meanwhile send the hostile mix: clients that hang up right after the final
message, cancels mid-stream, garbage bytes to the gateway, the target and a draft, requests through a
rogue drafter (served from this process) whose shared-memory reply is a bare length prefix claiming
2^31 bytes, requests through a rogue drafter that truncates its ring's segment under the gateway and rings it
(#44: the kernel must refuse every truncation; each request must come back whole, target-only, with the
reference tokens), and half-open HTTP
connections to the gateway's API (part of a request's headers, never the rest: each must be closed
within the gateway's read timeout), and floods of 300 idle TCP connections to the gateway's gRPC port (each
must be closed within its handshake timeout; those clients are `soak_hostile.py`). At the end it
prints requests served, errors by status, tokens lost (streams that differ from the reference or from
their usage; must be 0), what the hostile clients got, the sessions still open on the target and each
draft once the load stopped (must be 0) and the peak RSS of each service process, and exits 1 if any
token was lost, any session was left open, a garbage payload got anything but INVALID_ARGUMENT (or, from a
draft being killed or frozen, UNAVAILABLE / DEADLINE_EXCEEDED), a rogue-drafted request was not served
target-only with its reference tokens, a ring segment could be truncated, a half-open connection or a flooding one stayed open,
or any error other than RESOURCE_EXHAUSTED occurred.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.soak_hostile import (
    HOSTILE_KINDS,
    HTTP_READ_TIMEOUT_S,
    RogueDraft,
    connection_flood,
    half_open,
    hostile_call,
)

ALLOWED_ERRORS = ("RESOURCE_EXHAUSTED",)  # refusals past the admission queue are expected under load
# a frozen draft's sessions whose release the gateway skipped (its breaker was open) expire this soon
DRAFT_IDLE = ["--session-idle-timeout-s", "10"]
GARBAGE_OUTCOMES = ("INVALID_ARGUMENT", "UNAVAILABLE", "DEADLINE_EXCEEDED")
SESSIONS_SETTLE_S = 20.0  # after the load: how long open sessions may take to be released or expire
ROGUE = "rogue"  # the rogue-frame drafter's name at the gateway
SHRINKER = "shrinker"  # the ring-shrinking drafter's name at the gateway
ROGUE_OF = {"rogue_frame": ROGUE, "shrink_ring": SHRINKER}  # hostile kind -> the rogue drafter it goes through


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_kib(pid: int) -> int:
    """VmHWM: the process's peak resident set size (KiB); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class Service:
    """One specserve subcommand as a child process (output to a log file), restartable."""

    def __init__(self, role: str, argv: list[str], log_dir: Path, ready: str) -> None:
        self.role, self.argv, self.ready = role, argv, ready
        self.log_path = log_dir / f"{role}-{argv[1] if role == 'draft' else 'main'}.log"
        self.peak_kib = 0
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
        self.log = open(self.log_path, "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.cli.main", self.role, *self.argv],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready in self.log_path.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.role} not ready in {timeout_s} s; see {self.log_path}")

    def sample(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.peak_kib = max(self.peak_kib, _peak_rss_kib(self.proc.pid))

    def kill(self) -> None:
        self.sample()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        self.sample()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.served = 0
        self.tokens = 0
        self.lost = 0
        self.bad_streams = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}  # status -> one message
        self.by_draft: collections.Counter[str] = collections.Counter()
        self.fallbacks = 0
        self.hostile: collections.Counter[str] = collections.Counter()  # "kind: outcome" -> count


def _stream(stub, request, timeout_s: float):
    import grpc

    ids, final = [], None
    try:
        for msg in stub.Generate(request, timeout=timeout_s):
            if msg.HasField("final"):
                final = msg.final
            else:
                ids.extend(msg.delta.token_ids)
    except grpc.RpcError as exc:
        return ids, None, (exc.code().name, exc.details())
    return ids, final, None


def _lost(ids: list[int], ref: list[int], final) -> int:
    """Tokens that differ from the reference (missing, extra, wrong or out of order) or from the usage."""
    same = 0
    for a, b in zip(ids, ref):
        if a != b:
            break
        same += 1
    return (len(ids) - same) + (len(ref) - same) + abs(final.usage.completion_tokens - len(ids))


@dataclass(frozen=True)
class SoakConfig:
    """The soak's settings (tools/soak.py: their flags and help)."""

    seconds: float = 60.0  # how long to run the load
    model: Path | None = None  # target checkpoint (None: the shipped demo)
    draft_model: Path | None = None  # `model` drafter checkpoint (None: the shipped demo drafter with the demo)
    workers: int = 12  # client threads sending requests back to back
    max_sessions: int = 8  # gateway sessions (more queue)
    max_queued: int = 2  # gateway queue (more: RESOURCE_EXHAUSTED)
    max_new_tokens: int = 48
    kill_every_s: float = 12.0  # SIGKILL (or, every other time, SIGSTOP) a draft service this often
    freeze_s: float = 4.0  # how long a frozen draft stays stopped
    hostile_workers: int = 3  # threads sending hang-ups, cancels and garbage bytes
    seed: int = 0


def run(args: SoakConfig) -> int:
    """The soak (module docstring); 0 when nothing was lost, 1 otherwise."""

    import grpc

    from specserve.paths import demo_checkpoint
    from specserve.protos.specserve.v1 import gateway_pb2, gateway_pb2_grpc
    from specserve.runtime.servers_common import channel_options

    model = args.model or demo_checkpoint("target")
    draft_model = args.draft_model
    if draft_model is None and args.model is None:
        draft_model = demo_checkpoint("model")
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"specserve-soak-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: _free_port() for name in ("target", "ngram", "model", "gateway", "http", ROGUE, SHRINKER)}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    services: dict[str, Service] = {
        "target": Service(
            "target",
            ["--model", str(model), "--listen", addr["target"], "--num-kv-blocks", "512"],
            log_dir,
            "target listening on ",
        ),
        "ngram": Service(
            "draft",
            ["--draft", "ngram", "--model", str(model), "--listen", addr["ngram"], *DRAFT_IDLE],
            log_dir,
            "draft (ngram) listening on ",
        ),
    }
    drafts = ["ngram", "none"]
    if draft_model is not None:
        services["model"] = Service(
            "draft",
            [
                "--draft",
                "model",
                "--draft-model",
                str(draft_model),
                "--model",
                str(model),
                "--listen",
                addr["model"],
                *DRAFT_IDLE,
            ],
            log_dir,
            "draft (model) listening on ",
        )
        drafts.append("model")
    rogue = RogueDraft(addr[ROGUE])
    shrinker = RogueDraft(addr[SHRINKER], attack="shrink")
    services["gateway"] = Service(
        "gateway",
        [
            "--target",
            addr["target"],
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["gateway"]),
            "--max-sessions",
            str(args.max_sessions),
            "--max-queued",
            str(args.max_queued),
            "--http-port",
            str(ports["http"]),
            "--http-read-timeout-s",
            str(HTTP_READ_TIMEOUT_S),
            *[a for d in [*drafts, ROGUE, SHRINKER] if d != "none" for a in ("--draft-service", f"{d}={addr[d]}")],
        ],
        log_dir,
        "gateway listening on ",
    )
    tally = Tally()
    stop = threading.Event()
    try:
        for svc in services.values():
            svc.wait_ready(600)
        channel = grpc.insecure_channel(addr["gateway"], options=channel_options())
        stub = gateway_pb2_grpc.GatewayStub(channel)
        prompts = _prompts(model)
        refs = []
        for text in prompts:  # greedy references, target-only, one at a time
            ids, final, err = _stream(
                stub, gateway_pb2.GenerateRequest(prompt=text, max_new_tokens=args.max_new_tokens, draft="none"), 120
            )
            if err is not None:
                raise RuntimeError(f"reference request failed: {err}")
            refs.append(ids)
        print(
            f"soak: {len(services)} services up, {len(prompts)} references; load for {args.seconds:.0f} s "
            f"with {args.workers} workers, drafts {drafts}, a draft SIGKILL every {args.kill_every_s:.0f} s",
            flush=True,
        )

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                i, n, draft = rng.randrange(len(prompts)), rng.randint(1, args.max_new_tokens), rng.choice(drafts)
                req = gateway_pb2.GenerateRequest(
                    prompt=prompts[i], max_new_tokens=n, draft=draft, num_speculative_tokens=rng.choice((2, 4, 6))
                )
                ids, final, err = _stream(stub, req, 60)
                with tally.lock:
                    if err is not None:
                        tally.errors[err[0]] += 1
                        tally.examples.setdefault(err[0], err[1])
                if err is not None:
                    time.sleep(0.2 if err[0] in ALLOWED_ERRORS else 0.0)
                    continue
                with tally.lock:
                    lost = _lost(ids, refs[i][:n], final)
                    tally.served += 1
                    tally.tokens += len(ids)
                    tally.lost += lost
                    tally.bad_streams += bool(lost)
                    tally.by_draft[draft] += 1
                    tally.fallbacks += final.stats.draft_fallback

        def faults() -> None:
            victims = [d for d in drafts if d != "none"]
            k = 0
            while not stop.wait(args.kill_every_s):
                name = victims[k % len(victims)]
                victim = services[name]
                k += 1
                if k % 2 == 0:  # a frozen draft: the gateway's breaker must stop waiting for it
                    print(
                        f"soak: t+{time.monotonic() - t0:.0f}s SIGSTOP draft {name} for {args.freeze_s:.0f} s",
                        flush=True,
                    )
                    victim.proc.send_signal(signal.SIGSTOP)
                    stop.wait(args.freeze_s)
                    victim.proc.send_signal(signal.SIGCONT)
                    continue
                victim.kill()
                print(f"soak: t+{time.monotonic() - t0:.0f}s SIGKILL draft {name}, restarting", flush=True)
                if stop.wait(2.0):
                    break
                victim.start()

        def hostile(seed: int) -> None:
            rng = random.Random(seed)
            garbage_to = [
                (addr["gateway"], "/specserve.v1.Gateway/GenerateUnary"),
                (addr["target"], "/specserve.v1.TargetService/Prefill"),
                (addr["ngram"], "/specserve.v1.DraftService/StartSession"),
            ]
            while not stop.is_set():
                kind = rng.choice(HOSTILE_KINDS)
                draft = rng.choice(drafts)
                i = rng.randrange(len(prompts))
                req = gateway_pb2.GenerateRequest(prompt=prompts[i], max_new_tokens=rng.randint(4, 32), draft=draft)
                if kind in ROGUE_OF:
                    req.draft = ROGUE_OF[kind]
                    ids, final, err = _stream(stub, req, 60)
                    outcome = (
                        err[0]
                        if err is not None
                        else "fallback"
                        if final.stats.draft_fallback and not _lost(ids, refs[i][: req.max_new_tokens], final)
                        else "wrong"
                    )
                    if err is not None and err[0] in ALLOWED_ERRORS:
                        time.sleep(0.2)
                elif kind == "half_open":
                    outcome = half_open(ports["http"])
                elif kind == "conn_flood":
                    outcome = connection_flood(ports["gateway"])
                else:
                    outcome = hostile_call(kind, addr["gateway"], req, rng, garbage_to)
                with tally.lock:
                    tally.hostile[f"{kind}: {outcome}"] += 1

        def sampler() -> None:
            while not stop.wait(0.5):
                for svc in services.values():
                    svc.sample()

        t0 = time.monotonic()
        threads = [
            threading.Thread(target=worker, args=(args.seed * 1000 + w,), daemon=True) for w in range(args.workers)
        ]
        threads += [
            threading.Thread(target=hostile, args=(args.seed * 1000 + 500 + w,), daemon=True)
            for w in range(args.hostile_workers)
        ]
        threads += [threading.Thread(target=faults, daemon=True), threading.Thread(target=sampler, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        stop.set()
        for t in threads:
            t.join(90)
        elapsed = time.monotonic() - t0
        channel.close()
        left = _open_sessions(addr, [d for d in drafts if d != "none"], SESSIONS_SETTLE_S)
    finally:
        stop.set()
        for name in ("gateway", "model", "ngram", "target"):
            if name in services:
                services[name].stop()
        rogue.close()
        shrinker.close()
    unexpected = {k: v for k, v in tally.errors.items() if k not in ALLOWED_ERRORS}
    # garbage must get INVALID_ARGUMENT; UNAVAILABLE / DEADLINE_EXCEEDED: it hit a draft being killed or frozen
    bad_garbage = {
        k: v for k, v in tally.hostile.items() if k.startswith("garbage") and k.split(": ")[1] not in GARBAGE_OUTCOMES
    }
    bad_hostile = {
        k: v
        for k, v in tally.hostile.items()
        if (k.split(": ")[0] in ROGUE_OF and k.split(": ")[1] not in ("fallback", *ALLOWED_ERRORS))
        or k in ("half_open: left_open", "conn_flood: held")
    }
    summary = {
        "seconds": round(elapsed, 1),
        "requests_served": tally.served,
        "tokens_streamed": tally.tokens,
        "served_by_draft": dict(tally.by_draft),
        "draft_fallbacks": tally.fallbacks,
        "errors_by_status": dict(tally.errors),
        "error_examples": tally.examples,
        "tokens_lost": tally.lost,
        "streams_differing": tally.bad_streams,
        "peak_rss_mib": {name: round(svc.peak_kib / 1024, 1) for name, svc in services.items()},
        "hostile": dict(tally.hostile),
        "rogue_frames_sent": rogue.frames,
        "ring_shrinks": {"refused": shrinker.shrinks_refused, "done": shrinker.shrunk},
        "sessions_left_open": left,
    }
    print(
        f"soak: {tally.served} requests served in {elapsed:.0f} s ({tally.tokens} tokens), "
        f"errors by status {dict(tally.errors) or '{}'}, tokens lost {tally.lost}, "
        f"peak RSS MiB {summary['peak_rss_mib']}"
    )
    print(f"soak: hostile clients {dict(tally.hostile)}; sessions left open at the end {left}")
    print(json.dumps(summary, sort_keys=True))
    print(f"soak: logs in {log_dir}")
    return (
        1
        if (
            tally.lost
            or unexpected
            or not tally.served
            or any(left.values())
            or bad_garbage
            or bad_hostile
            or shrinker.shrunk
        )
        else 0
    )


def _open_sessions(addr: dict[str, str], drafts: list[str], settle_s: float) -> dict[str, int]:
    """Sessions still open on the target and each draft, polled until all are 0 or ``settle_s`` passed."""
    import grpc

    from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    deadline = time.monotonic() + settle_s
    while True:
        left = {}
        with grpc.insecure_channel(addr["target"]) as ch:
            stats = target_pb2_grpc.TargetServiceStub(ch).GetStats(target_pb2.TargetStatsRequest(), timeout=10)
            left["target"] = stats.active_sessions
        for name in drafts:
            with grpc.insecure_channel(addr[name]) as ch:
                try:
                    stats = draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.DraftStatsRequest(), timeout=10)
                    left[name] = stats.active_sessions
                except grpc.RpcError:
                    left[name] = -1  # not answering: cannot tell
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _prompts(model: Path) -> list[str]:
    """Held-out prompts shipped with the demo checkpoint (cut short), else a few fixed ones."""
    path = Path(model) / "heldout_prompts.json"
    if path.is_file():
        texts = json.loads(path.read_text())[:8]
        return [t[:120] for t in texts]
    return ["def main():\n    ", "import os\n", "class Queue:\n    def __init__(self", "for i in range(10):\n"]
