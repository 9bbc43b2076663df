"""Round trip of one small message between two processes: the shared-memory channel
(specserve/runtime/shm_ring.py) against a grpc.aio bidi stream over a unix socket (what the gateway
used for every step before the data plane).

    specserve bench overhead --ring [--bytes 200] [--n 3000] [--out DIR]

(`python -m specserve.tools.ring_rtt_peer` is the peers' entry point, started by this module.)

Each transport echoes ``--bytes`` bytes from a peer process ``--n`` times (after a warm-up) and
reports the median, p90 and p99 in microseconds:
- ``shm-async``: both ends on a uvloop event loop (``asend`` / ``arecv``) waking on the doorbell, as a
  session's channel runs in the services (no spin);
- ``shm-blocking``: both ends blocking (``send`` / ``recv``: ``select`` on the doorbell);
- ``...-spinN``: the same, each reader spinning N us on the ring first (``--spin-us``, 20);
- ``grpc-uds``: grpc.aio on uvloop, one bidi stream, request -> response, as ``_Stream.exchange``.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specserve.runtime.shm_layout import RingConfig
from specserve.runtime.shm_ring import ShmChannel

_METHOD = "/specserve.bench.Echo/Echo"


def _uvloop_run(coro):
    import uvloop

    return uvloop.run(coro)


# --------------------------------------------------------------------------------- shm peers
def _shm_peer(name: str, mode: str, spin_us: float) -> None:
    ch = ShmChannel.attach(name, RingConfig(spin_us=spin_us))
    if mode == "blocking":
        while True:
            msg = ch.recv()
            if not msg:
                return
            ch.send(msg)

    async def serve() -> None:
        while True:
            msg = await ch.arecv()
            if not msg:
                return
            await ch.asend(msg)

    _uvloop_run(serve())


def _stats(samples_s: list[float]) -> dict:
    us = sorted(s * 1e6 for s in samples_s)
    pick = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return {
        "median_us": round(statistics.median(us), 2),
        "p90_us": round(pick(0.9), 2),
        "p99_us": round(pick(0.99), 2),
        "n": len(us),
    }


def bench_shm(mode: str, nbytes: int, n: int, warmup: int, spin_us: float) -> dict:
    cfg = RingConfig(spin_us=spin_us)
    ch = ShmChannel.create(cfg)
    peer = _start_peer("--shm-peer", ch.ticket, mode, str(spin_us))
    payload = os.urandom(nbytes)
    try:
        if mode == "blocking":
            times = []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                ch.send(payload)
                ch.recv(timeout=10)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            ch.send(b"")
        else:

            async def run() -> list[float]:
                await ch.wait_attached(30)
                times = []
                for i in range(warmup + n):
                    t0 = time.perf_counter()
                    await ch.asend(payload)
                    await ch.arecv(timeout=10)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
                await ch.asend(b"")
                return times

            times = _uvloop_run(run())
    finally:
        peer.wait(10)
        ch.close()
    return _stats(times)


# -------------------------------------------------------------------------------- gRPC peers
def _start_peer(*argv: str) -> subprocess.Popen:
    """A peer in its own process (as the services are: its own resource tracker too)."""
    return subprocess.Popen(
        [sys.executable, "-m", "specserve.tools.ring_rtt_peer", *argv], stdout=subprocess.PIPE, text=True
    )


def _grpc_peer(address: str) -> None:
    import grpc

    async def echo(request_iterator, context):
        async for msg in request_iterator:
            yield msg

    async def serve() -> None:
        from specserve.runtime.servers_common import server_options

        server = grpc.aio.server(options=server_options())
        handler = grpc.stream_stream_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("specserve.bench.Echo", {"Echo": handler}),)
        )
        server.add_insecure_port(address)
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    _uvloop_run(serve())


def bench_grpc(nbytes: int, n: int, warmup: int) -> dict:
    import grpc

    from specserve.runtime.servers_common import channel_options

    folder = tempfile.mkdtemp(prefix="specserve-rtt-")
    address = f"unix:{folder}/echo.sock"
    peer = _start_peer("--grpc-peer", address)
    if peer.stdout.readline().strip() != "ready":
        raise RuntimeError("the gRPC echo peer did not start")
    payload = os.urandom(nbytes)

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
            call = channel.stream_stream(_METHOD)()
            times = []
            for i in range(warmup + n):
                t0 = time.perf_counter()
                await call.write(payload)
                await call.read()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            await call.done_writing()
            return times

    try:
        times = _uvloop_run(run())
    finally:
        peer.terminate()
        peer.wait(10)
        for p in Path(folder).iterdir():
            p.unlink()
        os.rmdir(folder)
    return _stats(times)


def run(nbytes: int = 200, n: int = 3000, warmup: int = 300, spin_us: float = 20.0) -> dict:
    """The round trip of every transport, by name (each against its own peer process)."""
    if nbytes < 1 or n < 1 or warmup < 0 or spin_us < 0:
        raise ValueError(
            f"the ring round trip needs --bytes and --n >= 1, --warmup and --spin-us >= 0, got "
            f"{nbytes}, {n}, {warmup}, {spin_us}"
        )
    spin = f"spin{spin_us:g}"
    return {
        "shm-async": bench_shm("async", nbytes, n, warmup, 0.0),
        f"shm-async-{spin}": bench_shm("async", nbytes, n, warmup, spin_us),
        "shm-blocking": bench_shm("blocking", nbytes, n, warmup, 0.0),
        f"shm-blocking-{spin}": bench_shm("blocking", nbytes, n, warmup, spin_us),
        "grpc-uds": bench_grpc(nbytes, n, warmup),
    }


def format_result(results: dict, nbytes: int, n: int) -> str:
    lines = [
        f"round trip of {nbytes} bytes, {n} times ({os.cpu_count()} CPUs, Python {platform.python_version()})",
        f"{'transport':<18} {'median us':>10} {'p90 us':>9} {'p99 us':>9}",
    ]
    for name, r in results.items():
        lines.append(f"{name:<18} {r['median_us']:>10.1f} {r['p90_us']:>9.1f} {r['p99_us']:>9.1f}")
    return "\n".join(lines)


def run_peer(shm_peer: tuple[str, str, str] | None, grpc_peer: str | None) -> None:
    """A peer's loop (tools/ring_rtt_peer.py starts it in its own process): a ring's or a gRPC server's end."""
    if shm_peer:
        _shm_peer(shm_peer[0], shm_peer[1], float(shm_peer[2]))
    else:
        _grpc_peer(grpc_peer)
