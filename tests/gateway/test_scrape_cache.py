"""The gateway's /metrics pieces that keep a scrape flood off the services and the event loop (issue #44 finding 8):
ScrapeCache renders the relayed text at most once an interval (concurrent scrapes share one render), ScrapePacer
answers scrapes one at a time, gap_s apart, and refuses them past max_waiting."""

from __future__ import annotations

import asyncio

import pytest

from specserve.gateway.metrics_relay import ScrapeCache, ScrapePacer, ScrapesBusy


def test_a_cache_renders_once_an_interval_and_shares_a_render():
    now = [100]

    async def run():
        started = asyncio.Event()

        async def render() -> bytes:
            started.set()
            await asyncio.sleep(0.01)
            return f"at {now[0]}".encode()

        cache = ScrapeCache(render, 5.0, clock=lambda: now[0])
        first = await asyncio.gather(*(cache.get() for _ in range(20)))  # at once: one render
        assert set(first) == {b"at 100"} and cache.renders == 1
        now[0] += 4
        assert await cache.get() == b"at 100" and cache.renders == 1  # within the interval: kept
        now[0] += 2
        assert await cache.get() == b"at 106" and cache.renders == 2

        async def broken() -> bytes:
            raise RuntimeError("down")

        failing = ScrapeCache(broken, 5.0)
        for _ in range(2):  # a failed render is not kept: the next scrape tries again
            with pytest.raises(RuntimeError):
                await failing.get()

    asyncio.run(run())


def test_a_pacer_takes_scrapes_in_turn_and_refuses_a_crowd():
    async def run():
        pacer = ScrapePacer(gap_s=0.05, max_waiting=4)
        loop = asyncio.get_running_loop()
        times = []

        async def scrape():
            async with pacer.turn():
                times.append(loop.time())

        await asyncio.gather(*(scrape() for _ in range(4)))
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert len(times) == 4 and min(gaps) >= 0.045, gaps
        waiting = [asyncio.ensure_future(scrape()) for _ in range(6)]  # one in its turn, 4 waiting, one too many
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert sum(isinstance(r, ScrapesBusy) for r in results) == 1

    asyncio.run(run())
