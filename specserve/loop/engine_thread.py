"""In process, the step loop runs on the engine's thread: `generate`, `bench` and `bench overhead`'s ``process``.

``EngineThread`` gives the engine a thread with an event loop of its own, and runs each request's step loop
(specserve/loop/step_loop.py's ``run_request``, the one loop of every mode) there as a task. Its target is a direct
``LocalTarget`` and its drafter an ``InlineDraft`` (specserve/loop/local.py): a prefill, a verify and a propose are plain
calls on the thread that launches the target's graph, so a step hands nothing to another thread and waits on no
wake-up (the threaded adapters cost two round trips a step: loop -> drafter -> loop -> engine -> loop). Only a block
drafted ahead runs on the drafter's own thread, to overlap the verify.

Several requests share the thread: while more than one was handed to it, each task yields after each step's event,
so their steps take turns. A lone request yields only when another thread handed the loop something else (a
cancellation: ``_handed``), since a direct step never waits on anything: a yield a step was one turn of the event
loop (a poll of its file descriptors) a step for nothing, a fifth of the in-process step's host time here (issue #42).
The caller's event loop only receives the events (one ``call_soon_threadsafe`` a step, which the step does not wait
for); closing the caller's iterator early cancels the request's task there, which releases both sessions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specserve.loop.local import InlineDraft, LocalDraft, LocalTarget
from specserve.loop.step_loop import FinalEvent, TokenEvent, run_request
from specserve.runtime.worker import new_loop

_END = object()  # the queue item after a request's last event


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class EngineThread:
    """The engine's own thread, running an event loop on which every request's step loop runs (module docstring).
    ``close`` stops it (after the requests running there ended)."""

    def __init__(self, engine, name: str = "target-engine") -> None:
        self.engine = engine
        self.target = LocalTarget(engine, direct=True)  # call it only from this thread
        self._loop = new_loop()
        self._drafts: dict[int, InlineDraft] = {}  # one InlineDraft per LocalDraft (its count of calls on its thread)
        # requests handed to the thread (counted by the callers, under the lock) and ended there: while more than one
        # is on it, each step yields (a request is counted when handed, not when its task starts, which takes a turn)
        self._lock = threading.Lock()
        self._submitted = 0
        self._ended = 0
        # set by another thread just after it handed the loop a callback (a cancellation, the loop's stop), cleared
        # there by the step that then yields to it
        self._handed = False
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def _inline(self, draft: LocalDraft | None) -> InlineDraft | None:
        if draft is None:
            return None
        inline = self._drafts.get(id(draft))
        if inline is None or inline.draft is not draft:
            inline = self._drafts[id(draft)] = InlineDraft(draft)
        return inline

    async def generate(
        self,
        request,
        draft: LocalDraft | None,
        on_event: Callable[[object], None] | None = None,
        tokens: bool = True,
        **kwargs,
    ) -> AsyncIterator[TokenEvent | FinalEvent]:
        """``run_request(request, this engine, draft, **kwargs)`` on the engine's thread, its events here.
        ``on_event(event)`` runs on the engine's thread as each event is made (a benchmark's clock); kwargs'
        ``on_step`` runs there too. ``tokens=False``: only the FinalEvent comes here (a caller that reads only the
        end, a benchmark: waking its loop a step costs the engine's thread the GIL while that loop runs)."""
        caller = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                caller.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the caller's loop closed: nobody reads
                pass

        async def steps() -> None:  # on the engine's thread
            try:
                async for event in run_request(request, self.target, self._inline(draft), **kwargs):
                    if on_event is not None:
                        on_event(event)
                    if tokens or isinstance(event, FinalEvent):
                        put(event)
                    if self._submitted - self._ended > 1 or self._handed:  # the others take a turn
                        self._handed = False
                        await asyncio.sleep(0)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller (cancellation included)
                put(_Failed(exc))
                raise
            finally:
                self._ended += 1
                put(_END)

        with self._lock:
            self._submitted += 1
        try:
            task = asyncio.run_coroutine_threadsafe(steps(), self._loop)
        except BaseException:
            with self._lock:
                self._submitted -= 1
            raise
        try:
            while True:
                item = await events.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            task.cancel()  # a caller that stopped reading: the request's task ends there, releasing its sessions
            self._handed = True  # after the hand-over: a step that sees it yields to it

    def close(self) -> None:
        """Stop the thread's loop and wait for it (from synchronous code, not from the thread)."""
        if not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._handed = True
        self._thread.join()
        self._loop.close()
