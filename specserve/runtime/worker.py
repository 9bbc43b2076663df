"""The one-thread owner every service uses for its model: the event loop only awaits, the model runs here.

A call is the step's hot path (two thread hops per verify or propose), so it is one queue put and one
``call_soon_threadsafe`` back: no ``concurrent.futures`` Future, no ``wrap_future`` chain and no
executor bookkeeping between the loop and the thread (``run_in_executor`` costed about twice as much
per hop, ``specserve bench overhead``). ``LoopThread`` is the same contract on a thread that runs an event loop
of its own, so a coroutine may run beside the model too (the target's served step loop: its verify is then a plain
call, no hop).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_STOP = None  # the queue item that ends the thread


class _Worker:
    """What OneThread and LoopThread share: ``call`` over their ``submit``, and closing over their ``_stop``."""

    _thread: threading.Thread

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run fn(*args) on the thread; await the returned future for its result (or exception)."""
        fut = asyncio.get_running_loop().create_future()
        self.submit(fn, args, lambda result, error: _settle(fut, result, error), fut)
        return fut

    def close(self) -> None:
        """Wait for the queued calls, then stop the thread (from synchronous code)."""
        self._stop()
        if self._thread is not threading.current_thread():
            self._thread.join()

    async def aclose(self) -> None:
        """The same, awaited from the event loop without blocking it."""
        self._stop()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


class OneThread(_Worker):
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


def new_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop (plain asyncio's without uvloop)."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # uvloop is a dependency; plain asyncio is only a fallback
        return asyncio.new_event_loop()


class LoopThread(_Worker):
    """OneThread's calls on a thread that runs an event loop of its own (``loop``): a call is a callback there, in
    the order of the calls, and coroutines may run there as tasks too (the target's served step loop,
    target_service/loop_serving.py: its verify is then a plain call on this thread, as the in-process loop's on
    specserve/loop/engine_thread.py's). The same contract as OneThread otherwise."""

    def __init__(self, name: str, init: Callable[[], object] | None = None) -> None:
        self.loop = new_loop()
        self._closed = False
        self._failed: list[BaseException] = []  # init's error (filled by the thread): every call gets it
        # set by another thread just after it handed the loop a callback (a call, a task to start or cancel); a
        # task there that never waits on anything (the served step loop's direct steps) reads it after each step
        # and yields to the loop when set (clearing it), so what was handed runs between two steps
        self.handed = False
        # the thread holds the loop, not this object, so a worker nobody closed is collected and its thread ends
        self._thread = threading.Thread(target=_run_loop, args=(self.loop, init, self._failed), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop_loop, self.loop)

    def on_thread(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.current_thread() is self._thread

    def submit(
        self,
        fn: Callable[..., Any],
        args: tuple,
        done: Callable[[Any, BaseException | None], None],
        skip_if: asyncio.Future | None = None,
    ) -> None:
        if self._closed:
            raise RuntimeError(f"{self._thread.name}: the worker thread was closed")
        self.hand(self._one, asyncio.get_running_loop(), skip_if, fn, args, done)

    def hand(self, callback: Callable[..., object], *args: Any) -> None:
        """``callback(*args)`` on the thread's loop, in the caller's context (from another thread)."""
        self.loop.call_soon_threadsafe(callback, *args)
        self.handed = True

    def _one(self, loop, skip_if, fn, args, done) -> None:
        if skip_if is not None and skip_if.cancelled():
            return
        _run_call(loop, fn, args, done, self._failed[0] if self._failed else None)

    def _stop(self) -> None:
        self._closed = True
        self._finalizer()  # stops the loop once, after the calls already handed over


def _run_loop(loop: asyncio.AbstractEventLoop, init: Callable[[], object] | None, failed: list) -> None:
    """A LoopThread's thread: init (its error kept in ``failed``), then the loop until it is stopped."""
    asyncio.set_event_loop(loop)
    try:
        if init is not None:
            init()
    except BaseException as exc:  # noqa: BLE001 - handed to every caller
        failed.append(exc)
    del init
    loop.run_forever()


def _stop_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # the loop was closed already
        pass


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
        _run_call(loop, fn, args, done, failed)
        del item, skip_if, fn, args, done  # hold nothing of the call while idle


def _run_call(loop, fn: Callable[..., Any], args: tuple, done, failed: BaseException | None) -> None:
    """On the worker's thread: fn(*args) (or init's error), its result or error to ``done`` on the caller's loop."""
    try:
        result, error = (None, failed) if failed is not None else (fn(*args), None)
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's callback
        result, error = None, exc
    try:
        loop.call_soon_threadsafe(done, result, error)
    except RuntimeError:  # the loop closed meanwhile: nobody waits for it
        pass


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """On the loop: complete the call's future (unless its waiter gave up)."""
    if fut.cancelled():
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
