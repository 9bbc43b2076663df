"""The one-thread owner every service uses for its model: the event loop only awaits, the model runs here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class OneThread:
    """One worker thread that owns a model (engine or proposer): every call runs there, one at a time."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        """Wait for the running call, then stop the thread (from synchronous code)."""
        self._pool.shutdown(wait=True)

    async def aclose(self) -> None:
        """The same, awaited from the event loop without blocking it."""
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
