"""Admission (specserve/runtime/admission.py): limits, FIFO queue, refusal past the queue, cancellation, KV units."""

from __future__ import annotations

import asyncio

import pytest

from specserve.runtime.admission import Admission, AdmissionConfig, AdmissionRefused


def run(coro):
    return asyncio.run(coro)


def test_sessions_queue_then_refuse_in_order():
    async def main():
        adm = Admission(AdmissionConfig(max_active=2, max_queued=2))
        await adm.acquire()
        await adm.acquire()
        order = []

        async def waiter(i):
            await adm.acquire()
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(2)]
        await asyncio.sleep(0)
        assert adm.queued == 2 and adm.active == 2
        with pytest.raises(AdmissionRefused, match="queue limit 2"):
            await adm.acquire()
        adm.release()
        await asyncio.sleep(0)
        assert order == [0]
        adm.release()
        await asyncio.gather(*tasks)
        assert order == [0, 1] and adm.active == 2 and adm.queued == 0

    run(main())


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        adm = Admission(AdmissionConfig(max_active=1, max_queued=1))
        await adm.acquire()
        task = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queued == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.queued == 0 and adm.active == 1
        adm.release()
        await asyncio.wait_for(adm.acquire(), 1)  # the slot is free again, nothing leaked
        assert adm.active == 1

    run(main())


def test_kv_units_reserve_and_never_overtake():
    async def main():
        adm = Admission(AdmissionConfig(max_active=10, max_queued=5, capacity=10, what="sessions"))
        with pytest.raises(AdmissionRefused, match="more than the whole cache"):
            await adm.acquire(11)
        await adm.acquire(6)
        big = asyncio.create_task(adm.acquire(5))  # does not fit beside 6
        await asyncio.sleep(0)
        small = asyncio.create_task(adm.acquire(1))  # would fit, but must not overtake the head
        await asyncio.sleep(0)
        assert not big.done() and not small.done() and adm.queued == 2
        adm.release(6)
        await asyncio.gather(big, small)
        assert adm.units_held == 6 and adm.active == 2

    run(main())


def test_config_is_validated():
    with pytest.raises(ValueError):
        AdmissionConfig(max_active=0, max_queued=1)
    with pytest.raises(ValueError):
        AdmissionConfig(max_active=1, max_queued=-1)
