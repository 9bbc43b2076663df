"""The shared-memory data plane of one session: its per-step messages over a ``ShmChannel``
(specserve/runtime/shm_ring.py) instead of a gRPC stream, when the caller shares the host.

Control stays gRPC (sessions, admission, health, deadlines, cancellation, auth, errors, trace
context): the caller asks with ``want_shm`` in the session-start call (Prefill, StartSession), the
service offers a channel name in its reply, and the caller attaches (it can only when it sees the
service's /dev/shm, that is, on the same host); otherwise the session's steps use the gRPC stream as
before. The messages are the gRPC stream's protobuf messages, so the services check them exactly as
they do on the stream (nothing a peer sends can change the output distribution), and they carry
their trace context in the same field.

A frame is one byte of kind and then either a serialized message (``OK``) or, as a gRPC stream ends
with a status, a u32 status code and its UTF-8 details (``STATUS``). Like a stream, a session's
channel ends at the first error, when either side closes it or goes away (the doorbell pipe's
end-of-file), or at the session's deadline; the service then releases the session as it does when
a stream ends.
"""

from __future__ import annotations

import asyncio
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specserve.runtime.shm_layout import DEFAULT_MAX_MESSAGE, RingConfig, default_spin_us
from specserve.runtime.shm_ring import MessageTooLarge, PeerGone, RingError, RingTimeout, ShmChannel

SHM_ENV = "SPECSERVE_SHM"  # "0": no shared-memory data plane (flag: --no-shm)
OK, STATUS = 0, 1
_CODE = struct.Struct("<I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def shm_allowed(no_shm_flag: bool, environ) -> bool:
    """The data plane is on unless --no-shm or SPECSERVE_SHM=0 says otherwise."""
    return not no_shm_flag and environ.get(SHM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class FrameError(RingError):
    """A frame that is neither a message nor a status (the channel is dropped)."""


class StatusFrame(Exception):
    """The peer ended the session's channel with a gRPC status (as a stream's abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    def as_rpc_error(self) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), self.details)


def encode_message(message) -> bytes:
    return bytes((OK,)) + message.SerializeToString()


def encode_status(code: grpc.StatusCode, details: str) -> bytes:
    return bytes((STATUS,)) + _CODE.pack(code.value[0]) + details.encode("utf-8", "replace")


def decode(frame: bytes, message_cls):
    """The message of an OK frame (protobuf's own parse errors propagate), or raise StatusFrame."""
    if not frame:
        raise FrameError("an empty frame")
    if frame[0] == OK:
        msg = message_cls()
        msg.ParseFromString(frame[1:])
        return msg
    if frame[0] == STATUS and len(frame) >= 1 + _CODE.size:
        (code,) = _CODE.unpack_from(frame, 1)
        raise StatusFrame(_CODES.get(code, grpc.StatusCode.UNKNOWN), frame[1 + _CODE.size :].decode("utf-8", "replace"))
    raise FrameError(f"a frame of kind {frame[0]}")


ANSWERED = object()  # a handler's return: the reply already went out (ShmSessions.sender), nothing to send


# By default no spin on a service's end of a session's channel: its next request comes a whole step after its answer,
# so a spin would only burn the event loop (per waiting session) before the doorbell wakes it anyway. The
# caller's end (ShmClient) busy-polls for its reply a bounded time first, where cores are plenty
# (``default_spin_us``: 20 us on hosts with >= 8 CPUs, none on fewer, where the spin takes the core its
# peer needs): a reply that comes within it (an n-gram proposal, a short verify) skips the doorbell wake-up.
# A drafter in a process of its own may be woken through the ring instead (`specserve draft --shm-spin-us`, issue
# #42): its end then spins that long for the next request before it blocks on the doorbell, but only while its
# channel is the service's one attached channel (ShmSessions._serve): with several, a spin would hold the event loop
# from the others' requests.
SESSION_RING = RingConfig(spin_us=0.0)


def session_ring(max_message: int = DEFAULT_MAX_MESSAGE, spin_us: float = 0.0) -> RingConfig:
    """A session channel's end that reads at most ``max_message`` bytes a message (the gRPC limit of the
    same hop: a longer frame drops the channel before anything is allocated), spinning ``spin_us`` on the
    ring before it sleeps on the doorbell."""
    return RingConfig(spin_us=spin_us, max_message=max_message)


@dataclass(frozen=True)
class ShmOffer:
    """How a service offers channels."""

    enabled: bool = True
    attach_timeout_s: float = 5.0  # a caller that has not attached by then uses gRPC; the names go
    # a caller that by then has neither attached nor sent a step over gRPC is taken for gone (a gateway
    # killed between the reply and its attach): its session is released, not left to the idle expiry
    abandon_s: float = 30.0
    ring: RingConfig = SESSION_RING
    # also keep a session's target hidden rows in a buffer its drafter maps (runtime/hidden_share.py), when
    # the caller asks (--no-hidden-share / SPECSERVE_HIDDEN_SHARE=0: never); needs ``enabled`` too
    hidden_share: bool = True

    @property
    def shares_hidden(self) -> bool:
        return self.enabled and self.hidden_share

    def __post_init__(self) -> None:
        if not self.attach_timeout_s > 0:
            raise ValueError(f"attach_timeout_s must be > 0, got {self.attach_timeout_s}")
        if not self.abandon_s >= self.attach_timeout_s:
            raise ValueError(f"abandon_s must be >= attach_timeout_s ({self.attach_timeout_s}), got {self.abandon_s}")


class ShmSessions:
    """A service's channels, one per session that asked for one (instance state, one per servicer).

    ``offer`` makes a channel and starts its serving task: requests are parsed with ``request_cls``
    and answered by ``handle(session_id, request)`` (the same step the gRPC stream runs); an exception becomes a
    status frame (``status_for`` + one line) and ends the channel. When an attached channel ends,
    ``on_end(session_id)`` runs (the service releases the session, as when its stream ends), and so it
    does for an offer nobody attached to whose session no step reached over gRPC either
    (``drop_offer``) within ``abandon_s``."""

    def __init__(
        self,
        role: str,
        offer: ShmOffer,
        request_cls,
        handle: Callable[[str, object], Awaitable[object]],
        status_for: Callable[[BaseException], grpc.StatusCode],
        on_end: Callable[[str], Awaitable[object]],
    ) -> None:
        self.role, self.config = role, offer
        self._request_cls, self._handle, self._status_for, self._on_end = request_cls, handle, status_for, on_end
        self._tasks: dict[str, asyncio.Task] = {}
        self._attached_sessions: set[str] = set()
        self._channels: dict[str, ShmChannel] = {}  # attached sessions' channels (their senders write to them)
        self._stepping: set[asyncio.Task] = set()  # serving tasks inside a step (their handler runs)
        self._stop_after_step: set[asyncio.Task] = set()  # released meanwhile: they end once the step is done
        self._served_here = 0  # replies the serving tasks sent (on the loop)
        self._served_by_thread = 0  # replies a sender sent (only ever written by the service's one model thread)
        self.attached = 0  # channels a caller attached to

    def offer(self, session_id: str, deadline_s: float | None) -> str:
        """A channel ticket for this session ("" when none can be made: the session stays on gRPC)."""
        if not self.config.enabled:
            return ""
        self.close_session(session_id)
        try:
            channel = ShmChannel.create(self.config.ring)
        except OSError as exc:
            print(
                f"{self.role}: no shared-memory channel ({exc}); session {session_id[:40]} uses gRPC",
                file=sys.stderr,
                flush=True,
            )
            return ""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        task = asyncio.get_running_loop().create_task(
            self._serve(session_id, channel, deadline), name=f"{self.role}-shm-{session_id[:16]}"
        )
        self._tasks[session_id] = task
        task.add_done_callback(
            lambda t, sid=session_id: self._tasks.pop(sid, None) if self._tasks.get(sid) is t else None
        )
        return channel.ticket

    @property
    def served(self) -> int:
        """Messages answered over shared memory (GetStats / tests)."""
        return self._served_here + self._served_by_thread

    def sender(self, session_id: str) -> Callable[[object], bool] | None:
        """For a handler whose reply is made on a worker thread: ``send(message)`` writes the reply
        into the session's channel from that thread at once (the reply does not wait for the loop to
        wake); False when it cannot (the handler's return is then sent as usual). The serving task
        sends nothing while its handler runs, so the thread is the channel's only writer then."""
        channel = self._channels.get(session_id)
        if channel is None:
            return None

        def send(message) -> bool:
            if not channel.try_send(encode_message(message)):
                return False
            self._served_by_thread += 1  # counted here: the session may be released before its task resumes
            return True

        return send

    def drop_offer(self, session_id: str) -> None:
        """The session's steps came over gRPC (its caller could not attach): withdraw a pending offer
        now rather than at the attach timeout. An attached channel is left alone."""
        task = self._tasks.get(session_id)
        if task is not None and session_id not in self._attached_sessions:
            self.close_session(session_id)

    def close_session(self, session_id: str) -> None:
        """The session was released: end its channel (the caller sees PeerGone). A step in flight
        finishes first (its reply may already have gone from the model's thread, and its span and
        counts complete); a released session's queued step fails there at once."""
        task = self._tasks.pop(session_id, None)
        if task is None:
            return
        if task in self._stepping:
            self._stop_after_step.add(task)
        else:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, session_id: str, channel: ShmChannel, deadline: float | None) -> None:
        attached = gone = False
        offered = time.monotonic()
        try:
            try:
                await channel.wait_attached(self.config.attach_timeout_s)
            except (RingTimeout, PeerGone):  # nobody came, or the caller took the segment and went (or refused it)
                channel.close()  # the name goes now
                # a caller going on over gRPC withdraws the offer at its first step (drop_offer cancels this)
                await asyncio.sleep(max(0.0, self.config.abandon_s - (time.monotonic() - offered)))
                gone = True
                return
            attached = True
            self.attached += 1
            self._attached_sessions.add(session_id)
            self._channels[session_id] = channel
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    await channel.asend(
                        encode_status(grpc.StatusCode.DEADLINE_EXCEEDED, "the session's deadline passed")
                    )
                    return
                try:  # a lone channel spins its bounded spin_us on the ring before the doorbell; several do not
                    frame = await channel.arecv(left, spin=len(self._channels) == 1)
                except RingTimeout:
                    continue  # the deadline check above ends it
                try:
                    request = decode(frame, self._request_cls)
                except (DecodeError, FrameError) as exc:  # as lenient_adder answers bytes that do not parse
                    await channel.asend(encode_status(grpc.StatusCode.INVALID_ARGUMENT, _one_line(exc)))
                    return
                me = asyncio.current_task()
                self._stepping.add(me)
                try:
                    response = await self._handle(session_id, request)
                except Exception as exc:  # noqa: BLE001 - mapped to a status, as the stream's abort
                    await channel.asend(encode_status(self._status_for(exc), _one_line(exc)))
                    return
                finally:
                    self._stepping.discard(me)
                if response is not ANSWERED:
                    try:
                        await channel.asend(encode_message(response))
                    except MessageTooLarge as exc:  # as gRPC refuses a reply over the caller's limit
                        await channel.asend(encode_status(grpc.StatusCode.RESOURCE_EXHAUSTED, _one_line(exc)))
                        return
                    self._served_here += 1
                if me in self._stop_after_step:
                    return
        except RingError:
            return  # the caller closed its end or went away
        finally:
            self._stop_after_step.discard(asyncio.current_task())
            if self._channels.get(session_id) is channel:
                del self._channels[session_id]
            channel.close()
            self._attached_sessions.discard(session_id)
            if attached or gone:
                asyncio.get_running_loop().create_task(self._on_end(session_id))


def _one_line(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _close_opened(opening: asyncio.Future) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


class ShmClient:
    """The caller's end of one session's channel: one request, then its response (the stream's
    ``exchange``). Any failure closes it; the caller maps it like the stream's."""

    def __init__(self, channel: ShmChannel) -> None:
        self.channel = channel

    @classmethod
    async def attach(cls, name: str, max_message: int = DEFAULT_MAX_MESSAGE) -> ShmClient | None:
        """None when the channel cannot be opened here (another host, or its service went), or what its service
        hands over is no sealed channel segment (ShmChannel.attach). ``max_message``: the largest reply read (a
        longer one is a RingError, the channel is dropped). The hand-over runs on a worker thread: a service
        that never hands its segment over costs this session the attach timeout, never the event loop."""
        if not name:
            return None
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, ShmChannel.attach, name, session_ring(max_message, default_spin_us()))
        try:
            return cls(await asyncio.shield(opening))
        except (OSError, RingError):
            return None
        except asyncio.CancelledError:  # the channel the thread still opens is closed when it is there
            opening.add_done_callback(_close_opened)
            raise

    async def exchange(self, request, response_cls, timeout: float | None):
        """Raises StatusFrame (the service's status), RingTimeout, or RingError / PeerGone."""
        try:
            await self.channel.asend(encode_message(request), timeout)
            frame = await self.channel.arecv(timeout)
            return decode(frame, response_cls)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.channel.close()
