"""Helpers for the service tests: specserve subcommands as real processes, and a real OTLP/gRPC
collector (grpc.aio TraceService + MetricsService from opentelemetry-proto) in a background thread."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ processes
# The child's first lines, then the CLI as `python -m specserve.cli.main` would run it: SIGTERM to the child when
# the thread that started it ends (prctl PR_SET_PDEATHSIG = 1), so a test run that dies any way (SIGTERM, SIGKILL,
# pytest-timeout's os._exit) leaves no service behind: a service stops on SIGTERM as on Proc.stop, its own
# children with it (serve); a test process gone before the prctl took ends the child at once. In the child, not
# a preexec_fn: that forks without vfork, and the test process's gRPC threads then break the child's event engine.
_STOP_WITH_PARENT = (
    "import ctypes, os, runpy, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0); "
    "os.getppid() == int(sys.argv.pop(1)) or os._exit(1); "
    "runpy.run_module('specserve.cli.main', run_name='__main__', alter_sys=True)"
)


class Proc:
    """A specserve subcommand in its own process; stdout lines are collected by a reader thread. Started
    on the main thread only: the child lives no longer than the thread that started it (_STOP_WITH_PARENT)."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str], merge_stderr: bool = True) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start a Proc on the main thread: its process stops when the starting thread ends")
        self.role, self.argv, self.env = role, argv, env
        self.lines: list[str] = []  # stdout (and stderr when merged)
        self.err_lines: list[str] = []
        self.popen = subprocess.Popen(
            [sys.executable, "-c", _STOP_WITH_PARENT, str(os.getpid()), role, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        self._readers = [threading.Thread(target=self._read, args=(self.popen.stdout, self.lines), daemon=True)]
        if not merge_stderr:
            self._readers.append(
                threading.Thread(target=self._read, args=(self.popen.stderr, self.err_lines), daemon=True)
            )
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def wait_line(self, prefix: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.popen.poll() is not None and not self._readers[0].is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(
            f"{self.role} did not print {prefix!r}; output:\n" + "\n".join((self.lines + self.err_lines)[-40:])
        )

    def stop(self, sig=None, timeout: float = 30.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig or signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for t in self._readers:
            t.join(timeout=5)
        return self.popen.returncode


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def wait_until(cond, timeout: float, what):
    """cond()'s first truthy value, polled every 20 ms; AssertionError naming ``what`` (a string, or a
    function that says what is still wrong when time is up) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")


# ---------------------------------------------------------------------------------- OTLP receiver
@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict


def _any_value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """A real OTLP/gRPC collector (traces + metrics) in a background thread with its own event loop."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.metric_names: set[str] = set()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("OTLP receiver did not start")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _main(self) -> None:
        import grpc
        from opentelemetry.proto.collector.metrics.v1 import (
            metrics_service_pb2,
            metrics_service_pb2_grpc,
        )
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            async def Export(self, request, context):
                receiver._add_spans(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            async def Export(self, request, context):
                with receiver._lock:
                    for rm in request.resource_metrics:
                        for sm in rm.scope_metrics:
                            receiver.metric_names.update(m.name for m in sm.metrics)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)

    def _add_spans(self, request) -> None:
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: _any_value(a.value) for a in rs.resource.attributes}
                service = attrs.get("service.name", "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            SpanRecord(
                                service=service,
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                attributes={a.key: _any_value(a.value) for a in s.attributes},
                            )
                        )

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)


class BackgroundServer:
    """grpc.aio servers in a background thread with their own event loop (for test-only services)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("background loop did not start")

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready.set()
        self._loop.run_forever()

    def serve(self, add_to_server, servicer, address: str) -> None:
        import grpc

        async def start():
            server = grpc.aio.server()
            add_to_server(servicer, server)
            server.add_insecure_port(address)
            await server.start()
            self._servers.append(server)

        asyncio.run_coroutine_threadsafe(start(), self._loop).result(20)

    def close(self) -> None:
        async def stop():
            for s in self._servers:
                await s.stop(0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(20)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
