"""A StartSession whose caller goes while its start runs on the drafter thread (a gateway SIGKILLed mid-call,
tests/gateway/test_hidden_share.py's fault test): the start runs to its end there, and the worker undoes it after,
on the thread, as the target frees a cancelled prefill. Before, the proposer kept the session and the mapped
hidden-row buffer for the process's life (the fault test saw a draft's hidden_buffers stay at 1)."""

from __future__ import annotations

import asyncio
import threading

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_worker import DrafterWorker
from specserve.draft_service.ngram import NgramProposer


class Mapping:
    """Stands in for the HiddenView a start with a hidden_share opens before the proposer's start (a host_shm
    buffer needs a target to hand it over)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_start_whose_caller_went_is_undone_after_it_ends_on_the_thread():
    on_thread, go_on = threading.Event(), threading.Event()
    mapping = Mapping()

    class SlowStart(NgramProposer):
        def start(self, session_id, token_ids, hidden, sampling) -> None:
            worker.views[session_id] = mapping
            on_thread.set()
            assert go_on.wait(10)
            super().start(session_id, token_ids, hidden, sampling)

    async def run() -> None:
        nonlocal worker
        worker = await DrafterWorker.build(lambda: SlowStart(DrafterConfig(family="ngram")))
        try:
            start = asyncio.create_task(worker.start("gone", [1, 2, 3], None, SamplingParams()))
            assert await asyncio.to_thread(on_thread.wait, 10)
            start.cancel()  # the caller went while the start runs on the thread
            await asyncio.gather(start, return_exceptions=True)
            assert "gone" not in worker.active
            go_on.set()
            for _ in range(200):
                if worker.proposer.active_sessions == 0 and not worker.views:
                    break
                await asyncio.sleep(0.02)
            assert worker.proposer.active_sessions == 0, "the proposer still holds the cancelled start's session"
            assert not worker.views and mapping.closed, "the cancelled start's buffer is still mapped"
            await worker.start("next", [4, 5, 6], None, SamplingParams())  # the worker goes on serving
            assert worker.proposer.active_sessions == 1
        finally:
            go_on.set()
            await worker.close()

    worker = None
    asyncio.run(run())
