"""The one-thread owner every service uses for its model: the event loop only awaits, the model runs here.

A call is the step's hot path (two thread hops per verify or propose), so it is one queue put and one
``call_soon_threadsafe`` back: no ``concurrent.futures`` Future, no ``wrap_future`` chain and no
executor bookkeeping between the loop and the thread (``run_in_executor`` costed about twice as much
per hop, ``specserve bench overhead``).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_STOP = None  # the queue item that ends the thread


class OneThread:
    """One worker thread that owns a model (engine or proposer): every call runs there, one at a time,
    in the order of the calls. A call whose awaiting task was cancelled before it started is skipped (as
    an executor skips a cancelled future); one that started runs to its end and its result is dropped.
    After ``close`` a call raises RuntimeError. ``init`` runs first on the thread (a drafter's thread makes its
    own CUDA stream current there: runtime/device_stream.py); if it raises, every call raises its error."""

    def __init__(self, name: str, init: Callable[[], object] | None = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=_serve, args=(self._queue, init), name=name, daemon=True)
        self._thread.start()
        # a worker nobody closed ends with its owner (daemon: interpreter exit never waits on an idle one)
        self._finalizer = weakref.finalize(self, self._queue.put, _STOP)

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on the thread; await the returned future for its result (or exception)."""
        fut = asyncio.get_running_loop().create_future()
        self.submit(fn, args, lambda result, error: _settle(fut, result, error), fut)
        return fut

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple,
        done: Callable[[Any, BaseException | None], None],
        skip_if: asyncio.Future | None = None,
    ) -> None:
        """Run fn(*args) on the thread, then ``done(result, error)`` on the calling loop (a plain
        callback: no task wakes in between). Skipped, done not called, when ``skip_if`` is cancelled
        before the call starts."""
        if self._closed:
            raise RuntimeError(f"{self._thread.name}: the worker thread was closed")
        self._queue.put((asyncio.get_running_loop(), skip_if, fn, args, done))

    def _stop(self) -> None:
        self._closed = True
        self._finalizer()  # puts the stop item once: calls already queued run first

    def close(self) -> None:
        """Wait for the queued calls, then stop the thread (from synchronous code)."""
        self._stop()
        if self._thread is not threading.current_thread():
            self._thread.join()

    async def aclose(self) -> None:
        """The same, awaited from the event loop without blocking it."""
        self._stop()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


def _serve(work: queue.SimpleQueue, init: Callable[[], object] | None) -> None:
    failed = None  # init's error: every call gets it
    try:
        if init is not None:
            init()
    except BaseException as exc:  # noqa: BLE001 - handed to every caller
        failed = exc
    del init
    while True:
        item = work.get()
        if item is _STOP:
            return
        loop, skip_if, fn, args, done = item
        if skip_if is not None and skip_if.cancelled():  # read from this thread: a cancel just missed is dropped later
            continue
        try:
            result, error = (None, failed) if failed is not None else (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's callback
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(done, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass
        del item, skip_if, fn, args, done, result, error  # hold nothing of the call while idle


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the loop: complete the call's future (unless its waiter gave up)."""
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
