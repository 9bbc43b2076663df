"""SessionHost (specserve/runtime/session_host.py): the one shell of the draft's and the target's model thread."""

from __future__ import annotations

import asyncio
import time

from specserve.runtime.session_host import SessionHost
from specserve.runtime.worker import OneThread


def _slow_batch(seconds: float):
    def run(pairs):
        time.sleep(seconds)
        return [payload * 2 for _, payload in pairs]

    return run


def test_a_step_on_the_thread_longer_than_the_idle_timeout_keeps_its_session():
    """The idle expiry spares a session while any call of it is in flight, running on the thread included (not only
    while it waits in the queue): a verify or a proposal slower than the timeout cannot lose its session."""
    host = SessionHost("unit", OneThread("unit-host"), idle_timeout_s=0.1, run_batch=_slow_batch(0.6), max_batch=1)
    released: list[str] = []

    async def release(sid: str) -> None:
        released.append(sid)
        host.forget(sid)

    async def main():
        host.sessions["s"] = 1
        host.touch("s")
        host.start_expiry(release, lambda sid: True)
        out = await host.step("s", 21)
        during = list(released)
        await asyncio.sleep(0.4)  # idle now: it goes
        await host.close()
        return out, during

    out, during = asyncio.run(main())
    assert out.result == 42
    assert during == [] and released == ["s"]


def test_a_step_whose_session_left_without_forget_fails_instead_of_hanging():
    """A step still queued when its session leaves the table (not through forget) gets an error, not a wait for
    ever."""
    host = SessionHost("unit", OneThread("unit-host"), idle_timeout_s=60, run_batch=_slow_batch(0.3), max_batch=1)

    async def main():
        host.sessions.update(a=1, b=1)
        first = asyncio.ensure_future(host.step("a", 1))
        await asyncio.sleep(0.05)  # a's step runs on the thread; b's waits behind it
        second = asyncio.ensure_future(host.step("b", 2))
        await asyncio.sleep(0.05)
        del host.sessions["b"]
        done = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 5)
        await host.close()
        return done

    first, second = asyncio.run(main())
    assert first.result == 2
    assert isinstance(second, RuntimeError) and "released" in str(second)
