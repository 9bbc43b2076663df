"""The gateway's drafts by name: draft name -> its endpoint (gateway/remote_draft.py), swappable at run
time (SetDraft), an endpoint that is replaced or removed closed once the requests using it are done."""

from __future__ import annotations

import asyncio

from specserve.loop.remote_draft import BreakerConfig, RemoteDraftEndpoint
from specserve.runtime.servers_common import TlsFiles, check_address


class DraftTable:
    """Draft name -> endpoint, swappable at run time. A replaced endpoint stays open until the
    requests that use it finish (counted), then its channel closes."""

    def __init__(
        self,
        step_timeout_s: float,
        tls: TlsFiles | None = None,
        target_info=None,
        breaker: BreakerConfig | None = None,
        token: str | None = None,
        shm: bool = True,
        hidden_share: bool = True,
    ) -> None:
        self.step_timeout_s = step_timeout_s
        self.shm = shm
        self.hidden_share = hidden_share
        self.breaker = breaker
        self.token = token
        self.tls = tls
        self.target_info = target_info
        self._by_name: dict[str, RemoteDraftEndpoint] = {}
        self._users: dict[int, int] = {}
        self._retired: dict[int, RemoteDraftEndpoint] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def addresses(self) -> dict[str, str]:
        return {n: e.address for n, e in self._by_name.items()}

    def endpoints(self) -> dict[str, RemoteDraftEndpoint]:
        return dict(self._by_name)

    def make(self, name: str, address: str, trusted: bool = False) -> RemoteDraftEndpoint:
        return RemoteDraftEndpoint(
            name,
            check_address(address),
            self.step_timeout_s,
            self.tls,
            self.target_info,
            trusted=trusted,
            breaker=self.breaker,
            token=self.token,
            shm=self.shm,
            hidden_share=self.hidden_share,
        )

    def put(self, endpoint: RemoteDraftEndpoint) -> None:
        old = self._by_name.get(endpoint.name)
        self._by_name[endpoint.name] = endpoint
        if old is not None:
            self._retire(old)

    def remove(self, name: str) -> None:
        old = self._by_name.pop(name, None)
        if old is not None:
            self._retire(old)

    def acquire(self, name: str) -> RemoteDraftEndpoint:
        ep = self._by_name[name]
        self._users[id(ep)] = self._users.get(id(ep), 0) + 1
        return ep

    def release(self, ep: RemoteDraftEndpoint) -> None:
        left = self._users.get(id(ep), 1) - 1
        self._users[id(ep)] = left
        if left <= 0:
            self._users.pop(id(ep), None)
            if id(ep) in self._retired:
                self._retired.pop(id(ep))
                asyncio.get_running_loop().create_task(ep.close())

    def _retire(self, ep: RemoteDraftEndpoint) -> None:
        if self._users.get(id(ep), 0) > 0:
            self._retired[id(ep)] = ep
        else:
            asyncio.get_running_loop().create_task(ep.close())

    async def close(self) -> None:
        for ep in [*self._by_name.values(), *self._retired.values()]:
            await ep.close()
