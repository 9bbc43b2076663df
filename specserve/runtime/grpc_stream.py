"""A caller's gRPC plumbing shared by the step loop's remote clients (the gateway's target client, gateway/remote.py;
the draft client, specserve/loop/remote_draft.py, in the gateway and in the target's own loop): a request's deadline on
the event loop's clock, and a bidi stream used strictly request -> response."""

from __future__ import annotations

import asyncio

import grpc

RELEASE_TIMEOUT_S = 2.0  # releases run even past the request's deadline, but never hang


class Deadline:
    """A request's absolute deadline on the event loop's clock (None = no deadline)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def remaining(self, cap: float | None = None) -> float | None:
        if self.deadline is None:
            return cap
        left = self.deadline - asyncio.get_running_loop().time()
        return left if cap is None else min(left, cap)


class BidiStream:
    """A bidi stream used strictly request -> response, opened on first use."""

    def __init__(self, opener) -> None:
        self._opener = opener
        self._call = None

    async def exchange(self, request, timeout: float | None):
        if self._call is None:
            self._call = self._opener()
        try:
            await self._call.write(request)
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # the peer ended the call meanwhile
            status = await self._status()
            if status is not None:
                raise status from None
            raise EOFError(f"the stream already ended: {exc}") from None
        if timeout is None:
            resp = await self._call.read()
        else:  # a timeout on this task (asyncio.wait_for would wrap the read in a task of its own every step)
            async with asyncio.timeout(timeout):
                resp = await self._call.read()
        if resp is grpc.aio.EOF:
            raise EOFError("the stream ended without a response")
        return resp

    async def _status(self) -> grpc.aio.AioRpcError | None:
        """The ended call's status as an AioRpcError (None when it ended OK or cannot tell)."""
        try:
            code = await asyncio.wait_for(self._call.code(), 1.0)
            details = await asyncio.wait_for(self._call.details(), 1.0)
        except Exception:  # noqa: BLE001 - no status to report
            return None
        if code == grpc.StatusCode.OK:
            return None
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
