"""OneThread and LoopThread (specserve/runtime/worker.py): the one thread that owns a model, and its hop to and from
the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve.runtime.worker import LoopThread, OneThread


def test_calls_run_on_one_named_thread_in_order_and_return_or_raise():
    worker = OneThread("unit-owner")
    seen: list[tuple[int, str]] = []

    def work(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("three")
        return i * 10

    async def main():
        futs = [worker.call(work, i) for i in range(5)]
        return await asyncio.gather(*futs, return_exceptions=True)

    try:
        out = asyncio.run(main())
    finally:
        worker.close()
    assert out[:3] == [0, 10, 20] and out[4] == 40
    assert isinstance(out[3], ValueError) and str(out[3]) == "three"
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {name for _, name in seen} == {"unit-owner"}


def test_the_loop_runs_while_a_call_works_and_a_cancelled_waiter_skips_what_had_not_started():
    worker = OneThread("unit-owner")
    gate = threading.Event()
    ran: list[str] = []

    def blocker() -> None:
        gate.wait(10)
        ran.append("blocker")

    async def main():
        first = worker.call(blocker)
        second = worker.call(ran.append, "second")
        await asyncio.sleep(0.01)  # the loop is not blocked by the running call
        second.cancel()  # before it started: it is skipped
        gate.set()
        await first
        third = worker.call(ran.append, "third")
        await third

    try:
        asyncio.run(main())
    finally:
        worker.close()
    assert ran == ["blocker", "third"]


def test_close_waits_for_queued_calls_then_refuses_new_ones():
    worker = OneThread("unit-owner")
    done: list[int] = []

    def slow(i: int) -> None:
        time.sleep(0.02)
        done.append(i)

    async def main():
        futs = [worker.call(slow, i) for i in range(3)]
        await worker.aclose()  # the queued calls run first
        await asyncio.gather(*futs)
        with pytest.raises(RuntimeError):
            worker.call(slow, 9)

    asyncio.run(main())
    assert done == [0, 1, 2]
    worker.close()  # closing twice is harmless


def test_a_call_whose_loop_closed_does_not_kill_the_thread():
    worker = OneThread("unit-owner")
    gate = threading.Event()

    async def leave_one_running():
        worker.call(gate.wait, 10)

    asyncio.run(leave_one_running())  # that loop is closed before the call ends
    gate.set()

    async def again():
        return await worker.call(lambda: 7)

    try:
        assert asyncio.run(again()) == 7
    finally:
        worker.close()


def test_init_runs_first_on_the_thread_and_a_failed_init_fails_every_call():
    """A drafter's thread makes its CUDA stream current in ``init`` (runtime/device_stream.py): it runs on the
    worker's own thread before any call; one that raises leaves the worker answering every call with its error."""
    seen: list[str] = []
    worker = OneThread("unit-owner", init=lambda: seen.append(threading.current_thread().name))

    def broken() -> None:
        raise RuntimeError("no stream")

    failed = OneThread("unit-broken", init=broken)

    async def main():
        return await worker.call(seen.append, "call"), await asyncio.gather(
            failed.call(seen.append, "x"), failed.call(seen.append, "y"), return_exceptions=True
        )

    try:
        _, errors = asyncio.run(main())
    finally:
        worker.close()
        failed.close()
    assert seen == ["unit-owner", "call"]
    assert [str(e) for e in errors] == ["no stream", "no stream"] and all(isinstance(e, RuntimeError) for e in errors)


@pytest.mark.parametrize("kind", [OneThread, LoopThread])
def test_a_worker_nobody_closed_ends_its_thread_when_collected(kind):
    """A worker dropped without close (an engine built and let go) stops its thread once collected: its thread holds
    the queue or the loop, not the worker. LoopThread's held the worker itself, so it never ended."""
    import gc

    async def main(worker):
        return await worker.call(threading.current_thread)

    worker = kind("unit-dropped")
    thread = asyncio.run(main(worker))
    assert thread.name == "unit-dropped" and thread.is_alive()
    del worker  # its last reference
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_loop_thread_answers_every_call_with_its_failed_init():
    def broken() -> None:
        raise RuntimeError("no stream")

    worker = LoopThread("unit-loop-broken", init=broken)

    async def main():
        return await asyncio.gather(worker.call(int, "1"), worker.call(int, "2"), return_exceptions=True)

    try:
        errors = asyncio.run(main())
    finally:
        worker.close()
    assert [str(e) for e in errors] == ["no stream", "no stream"]
