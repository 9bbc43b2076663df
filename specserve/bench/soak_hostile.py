"""The soak's hostile clients: rogue draft services (an oversized frame; a ring shrunk under the gateway), half-open
HTTP connections, floods of idle gRPC connections, garbage bytes, hang-ups and cancels (what `soak.py`'s hostile workers send beside the load; each
returns what it got)."""

from __future__ import annotations

import os
import random
import socket
import stat
import threading

HTTP_READ_TIMEOUT_S = 2.0  # the gateway's --http-read-timeout-s: a half-open connection must close by then
HOSTILE_KINDS = ("hang_up", "cancel", "garbage", "rogue_frame", "shrink_ring", "half_open", "conn_flood")
FLOOD_CONNECTIONS = 300  # idle TCP connections one conn_flood opens to the gateway's gRPC port
FLOOD_CLOSED_WITHIN_S = 3.0 + 3.0  # the gRPC handshake timeout (runtime/grpc_guard.py) and slack
SHM_TAGS = ("/memfd:", "/dev/shm/specserve-")  # how a memfd and a named segment show in /proc/PID/fd


def segment_fds() -> set[int]:
    """This process's descriptors of shared-memory files (memfds, /dev/shm segments; no sockets, no FIFOs): what a
    rogue drafter keeps of the segment it offers, to truncate it later."""
    out = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
            regular = stat.S_ISREG(os.stat(f"/proc/self/fd/{entry}").st_mode)
        except OSError:
            continue
        if regular and target.startswith(SHM_TAGS):
            out.add(int(entry))
    return out


class RogueDraft:
    """A rogue draft service in this process (its own thread and event loop): it offers each session a
    shared-memory channel and, once the gateway waits on it for the first proposal, attacks it. ``frame``: it
    answers with a 4-byte length prefix claiming 2^31 bytes, never a body. ``shrink`` (#44): it truncates the
    channel's segment to 0 bytes (through a descriptor it kept when it made the channel) and rings the doorbell, so
    a gateway that read the ring would die of SIGBUS; the kernel refuses the truncation of a sealed segment
    (``shrunk`` counts those it allowed: must stay 0). Over gRPC it drafts nothing. Vocabulary-agnostic (size 0),
    so it fits any target."""

    def __init__(self, address: str, attack: str = "frame") -> None:
        import asyncio

        if attack not in ("frame", "shrink"):
            raise ValueError(f"attack must be frame or shrink, got {attack!r}")
        self.address, self.attack = address, attack
        self.frames = 0
        self.shrunk = 0  # truncations the kernel allowed (a segment a peer could shrink: a SIGBUS waiting)
        self.shrinks_refused = 0
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)

    async def _start(self) -> None:
        import grpc

        from specserve.protos.specserve.v1 import draft_pb2_grpc

        self._server = grpc.aio.server()
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self._servicer(), self._server)
        self._server.add_insecure_port(self.address)
        await self._server.start()

    def _servicer(self):
        import asyncio

        from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc
        from specserve.runtime.shm_ring import ShmChannel

        rogue = self

        class Servicer(draft_pb2_grpc.DraftServiceServicer):
            async def GetInfo(self, request, context):
                return draft_pb2.DraftInfo(family="rogue", vocab_size=0, max_block_size=8)

            async def StartSession(self, request, context):
                ticket = ""
                if request.want_shm:
                    before = segment_fds()
                    channel = ShmChannel.create()
                    if rogue.attack == "shrink":
                        kept = [os.dup(fd) for fd in segment_fds() - before]
                        asyncio.get_running_loop().create_task(self._shrink(channel, kept))
                    else:
                        asyncio.get_running_loop().create_task(self._claim_two_gib(channel))
                    ticket = channel.ticket
                return draft_pb2.StartSessionResponse(session_id=request.session_id, shm_channel=ticket)

            async def _shrink(self, channel, kept: list[int]) -> None:
                try:
                    await channel.wait_attached(10)
                    await channel.arecv(30)  # the first proposal: the gateway now waits on the ring
                    for fd in kept:
                        try:
                            os.ftruncate(fd, 0)
                            rogue.shrunk += 1
                        except PermissionError:
                            rogue.shrinks_refused += 1
                    channel._ring_peer()
                    await asyncio.sleep(5)  # never answers, and never reads its own (maybe shrunk) mapping
                except Exception:  # noqa: BLE001 - the gateway dropped the channel
                    pass
                finally:
                    for fd in kept:
                        os.close(fd)
                    channel.close()

            async def _claim_two_gib(self, channel) -> None:
                try:
                    await channel.wait_attached(10)
                    await channel.arecv(30)
                    channel._rings.write_some([memoryview((1 << 31).to_bytes(4, "little"))], 0)  # the prefix alone
                    channel._ring_peer()
                    rogue.frames += 1
                    await asyncio.sleep(5)
                except Exception:  # noqa: BLE001 - the gateway dropped the channel (as it must)
                    pass
                finally:
                    channel.close()

            async def ProposeStream(self, request_iterator, context):
                async for req in request_iterator:
                    yield draft_pb2.ProposeResponse(session_id=req.session_id)

            async def Release(self, request, context):
                return draft_pb2.DraftReleaseResponse(released=True)

        return Servicer()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def half_open(http_port: int) -> str:
    """A connection that sends part of a request's headers and never the rest: "closed" when the gateway
    closes it within its read timeout (and some slack), else "left_open"."""
    with socket.create_connection(("127.0.0.1", http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Le")
        sock.settimeout(HTTP_READ_TIMEOUT_S + 2.0)
        try:
            while sock.recv(4096):
                pass
        except (TimeoutError, socket.timeout):
            return "left_open"
        except ConnectionResetError:
            pass
    return "closed"


def connection_flood(port: int, count: int = FLOOD_CONNECTIONS) -> str:
    """``count`` TCP connections to a gRPC port that never send a byte: "dropped" when the server has closed every
    one within FLOOD_CLOSED_WITHIN_S (its handshake timeout), else "held"."""
    import resource
    import time

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * count and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process's own sockets
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            socks.append(sock)
        open_ = list(socks)
        deadline = time.monotonic() + FLOOD_CLOSED_WITHIN_S
        while open_ and time.monotonic() < deadline:
            time.sleep(0.2)
            still = []
            for sock in open_:
                try:
                    if sock.recv(1 << 12):
                        still.append(sock)  # bytes (a SETTINGS frame): not closed yet
                except BlockingIOError:
                    still.append(sock)
                except OSError:
                    pass  # reset: closed
            open_ = still
        return "dropped" if not open_ else "held"
    finally:
        for sock in socks:
            sock.close()


def hostile_call(kind: str, gateway: str, req, rng: random.Random, garbage_to) -> str:
    """One hostile client; returns what it got ("ok" or a status name)."""
    import grpc

    from specserve.protos.specserve.v1 import gateway_pb2_grpc

    if kind == "garbage":
        address, method = rng.choice(garbage_to)
        with grpc.insecure_channel(address) as ch:
            try:
                ch.unary_unary(method)(rng.randbytes(rng.randint(1, 64)) + b"\xff\xff", timeout=10)
            except grpc.RpcError as exc:
                return exc.code().name
        return "ok"
    channel = grpc.insecure_channel(gateway)
    try:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=60)
        if kind == "cancel":  # cancel after the first delta
            next(call, None)
            call.cancel()
            return "cancelled"
        for msg in call:  # hang up right after the final message: the channel closes at once
            if msg.HasField("final"):
                break
        return "ok"
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()
