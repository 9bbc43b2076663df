"""The target's and the drafts' own state on the gateway's ``GET /metrics``: relayed from their GetStats at
scrape time, over the channels the gateway already holds (so it works wherever the gateway reaches them:
``serve``'s unix sockets, compose, other hosts; no port of theirs needs to be reachable).

``ScrapeCache`` keeps the relayed text: a scrape within ``interval_s`` of the last refresh gets it as it was, and
scrapes that come while a refresh runs wait for that one, so a flood of scrapes asks the services at most once an
interval (the gateway's own series are rendered at each scrape). ``ScrapePacer`` answers scrapes one at a time, at
least ``gap_s`` apart (10 a second: a Prometheus scrapes every 15 s or so), and refuses scrapes past ``max_waiting``
waiting ones: a flood of scrapes then waits, asleep, instead of taking the event loop from the requests.

Series (Prometheus names): ``specserve_upstream_up{service, draft}`` (1: it answered GetStats within the
timeout), the target's ``specserve_target_sessions``, ``_kv_blocks_total``, ``_kv_blocks_used``,
``_kv_cache_usage_ratio`` (used / total), ``_verify_steps_total``, ``_shm_steps_total``, ``_hidden_buffers``,
and each draft's ``specserve_draft_sessions{draft}``, ``_proposals_total``, ``_shm_proposals_total``. The
target's and the draft's own names (their ``--metrics-port``) are the same where the reading is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from specserve.protos.specserve.v1 import draft_pb2, target_pb2

RELAY_TIMEOUT_S = 1.0


class _Families:
    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


async def _ask(call, request, auth, timeout_s: float):
    try:
        return await call(request, timeout=timeout_s, metadata=auth)
    except Exception:  # noqa: BLE001 - a service that does not answer reads as up = 0
        return None


async def relay_text(target, drafts: dict, timeout_s: float = RELAY_TIMEOUT_S) -> bytes:
    """Prometheus text of the target's and each draft's GetStats (``drafts``: name -> RemoteDraftEndpoint)."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    names = sorted(drafts)
    answers = await asyncio.gather(
        _ask(target.stub.GetStats, target_pb2.TargetStatsRequest(), target.auth, timeout_s),
        *(_ask(drafts[n].stub.GetStats, draft_pb2.DraftStatsRequest(), drafts[n].auth, timeout_s) for n in names),
    )
    t, by_draft = answers[0], dict(zip(names, answers[1:]))
    up = GaugeMetricFamily(
        "specserve_upstream_up",
        "Whether a service answered the gateway's GetStats at this scrape",
        labels=("service", "draft"),
    )
    up.add_metric(("target", ""), float(t is not None))
    for n in names:
        up.add_metric(("draft", n), float(by_draft[n] is not None))
    families = [up]
    if t is not None:
        usage = t.kv_blocks_used / t.kv_blocks_total if t.kv_blocks_total else 0.0
        for name, kind, help_, value in (
            ("specserve_target_sessions", GaugeMetricFamily, "Open target sessions", t.active_sessions),
            ("specserve_target_kv_blocks_total", GaugeMetricFamily, "KV-cache blocks in all", t.kv_blocks_total),
            (
                "specserve_target_kv_blocks_used",
                GaugeMetricFamily,
                "KV-cache blocks holding a session's tokens",
                t.kv_blocks_used,
            ),
            ("specserve_target_kv_cache_usage_ratio", GaugeMetricFamily, "KV-cache blocks used / blocks in all", usage),
            ("specserve_target_verify_steps", CounterMetricFamily, "Verify steps the target served", t.steps),
            (
                "specserve_target_shm_steps",
                CounterMetricFamily,
                "Verify steps answered over shared memory",
                t.shm_steps,
            ),
            (
                "specserve_target_hidden_buffers",
                GaugeMetricFamily,
                "Sessions' shared hidden-row buffers open",
                t.hidden_buffers,
            ),
        ):
            families.append(kind(name, help_, value=float(value)))
    answered = [(n, s) for n, s in by_draft.items() if s is not None]
    if answered:
        sessions = GaugeMetricFamily("specserve_draft_sessions", "Open draft sessions", labels=("draft",))
        proposals = CounterMetricFamily(
            "specserve_draft_proposals", "Proposals the draft service served", labels=("draft",)
        )
        shm = CounterMetricFamily(
            "specserve_draft_shm_proposals", "Proposals answered over shared memory", labels=("draft",)
        )
        for n, s in answered:
            sessions.add_metric((n,), float(s.active_sessions))
            proposals.add_metric((n,), float(s.proposals))
            shm.add_metric((n,), float(s.shm_proposals))
        families += [sessions, proposals, shm]
    return generate_latest(_Families(families))


class ScrapeCache:
    """``render()``'s bytes, rendered at most once per ``interval_s`` (0: at each call, concurrent calls sharing one
    render); a render that fails is not kept."""

    def __init__(
        self, render: Callable[[], Awaitable[bytes]], interval_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self._render, self.interval_s, self._clock = render, interval_s, clock
        self._body: bytes | None = None
        self._at = 0.0
        self._running: asyncio.Task | None = None
        self.renders = 0  # how many times it rendered (tests, and a reader who wonders)

    async def get(self) -> bytes:
        if self._body is not None and self._clock() - self._at < self.interval_s:
            return self._body
        if self._running is None:
            self._running = asyncio.get_running_loop().create_task(self._refresh())
        return await asyncio.shield(self._running)  # one caller's cancel leaves the render to the others

    async def _refresh(self) -> bytes:
        try:
            body = await self._render()
            self.renders += 1
            self._body, self._at = body, self._clock()
            return body
        finally:
            self._running = None


class ScrapesBusy(Exception):
    """More scrapes are waiting than the pacer lets wait."""


class ScrapePacer:
    """Scrapes in turn (FIFO), one at a time and at least ``gap_s`` apart; past ``max_waiting`` waiting: ScrapesBusy."""

    def __init__(self, gap_s: float = 0.1, max_waiting: int = 32) -> None:
        self.gap_s, self.max_waiting = gap_s, max_waiting
        self.waiting = 0
        self._lock = asyncio.Lock()
        self._next = 0.0  # the loop's time before which no scrape starts

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if self.waiting >= self.max_waiting:
            raise ScrapesBusy(f"{self.waiting} scrapes are waiting their turn")
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        loop = asyncio.get_running_loop()
        try:
            if self._next > loop.time():
                await asyncio.sleep(self._next - loop.time())
            yield
        finally:
            self._next = loop.time() + self.gap_s
            self._lock.release()
