"""The servicers' side of the session host (session_host.py): one service's steps over gRPC and shared memory.

A service gives its one step, ``one(request, call_ctx, send)`` (the target's verify, the draft's propose:
decode, run on the model's thread, encode), and ``StepServing`` serves it three ways, the same checks each
way: a unary call, a bidi stream of a session's steps (its sessions are released when the stream ends,
however it ends), and a session's shared-memory channel (runtime/data_plane.py ``ShmSessions``, where
``send`` lets the model's thread send the reply itself). ``StepReply`` is that reply, made once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from specserve.protos import convert
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ANSWERED, ShmOffer, ShmSessions
from specserve.runtime.servers_common import short

StatusFor = Callable[[BaseException], grpc.StatusCode]


async def abort(context, status_for: StatusFor, exc: BaseException):
    """End the call with the exception's status and one line naming it."""
    await context.abort(status_for(exc), short(f"{type(exc).__name__}: {exc}"))


class StepReply:
    """A step's reply, made once: ``on_thread(*result)`` (the step's Answer) makes it on the model's thread
    and sends it at once (``send``, a shared-memory session's); ``message(*result)`` on the loop gives
    ANSWERED when it went out so, else the reply (the one the thread made, or a new one)."""

    def __init__(self, make: Callable[..., object], send: Callable[[object], bool] | None) -> None:
        self._make, self._send = make, send
        self._made = None

    @property
    def answer(self) -> Callable[..., bool] | None:
        """The Answer to give the model's thread (None without a sender: the loop replies)."""
        return None if self._send is None else self._on_thread

    def _on_thread(self, *result) -> bool:
        self._made = self._make(*result)
        return self._send(self._made)

    def message(self, answered: bool, *result):
        if answered:
            return ANSWERED
        if self._made is not None:  # made on the model's thread, which could not send it (no room in the ring)
            return self._made
        return self._make(*result)


class StepServing:
    """One service's steps as a unary call, a stream and shared-memory channels (see the module docstring).

    ``release(session_id)`` releases a session on the model's side (when its stream or channel ends, and
    for the Release call)."""

    def __init__(
        self,
        role: str,
        offer: ShmOffer | None,
        request_cls,
        one: Callable[..., Awaitable[object]],
        status_for: StatusFor,
        release: Callable[[str], Awaitable[bool]],
    ) -> None:
        self._one, self._status_for, self._release = one, status_for, release
        # sessions whose caller shares the host: their steps over shared memory (same messages)
        self.shm = ShmSessions(role, offer or ShmOffer(), request_cls, self._over_shm, status_for, release)

    async def abort(self, context, exc: BaseException):
        await abort(context, self._status_for, exc)

    async def _over_shm(self, session_id: str, request):
        if request.session_id != session_id:
            raise convert.ConversionError(f"session_id: {request.session_id[:40]!r} is not this channel's session")
        return await self._one(request, None, self.shm.sender(session_id))

    async def unary(self, request, context):
        call_ctx = tn.context_from_metadata(context.invocation_metadata())
        try:
            return await self._one(request, call_ctx)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await self.abort(context, exc)

    async def stream(self, request_iterator, context):
        """Per-session stream of steps. When the stream ends for any reason (the client cancelled, went
        away, or finished) the sessions it carried are released."""
        call_ctx = tn.context_from_metadata(context.invocation_metadata())
        sessions: set[str] = set()
        try:
            async for request in request_iterator:
                if request.session_id not in sessions:
                    self.shm.drop_offer(request.session_id)  # its caller could not attach (another host)
                sessions.add(request.session_id)
                try:
                    resp = await self._one(request, call_ctx)
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    await self.abort(context, exc)
                yield resp
        finally:
            # a separate task: the handler may be cancelled, the release must still happen
            for sid in sessions:
                asyncio.get_running_loop().create_task(self._release(sid))

    async def release(self, session_id: str, context) -> bool:
        """The Release call: end the session's channel, then release it."""
        self.shm.close_session(session_id)
        try:
            return await self._release(session_id)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await self.abort(context, exc)
