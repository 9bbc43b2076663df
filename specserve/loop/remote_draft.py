"""Remote draft adapter: the DraftClient protocol of specserve/loop/clients.py over gRPC, for whichever process runs
the step loop: the target's own loop (target_service/loop_serving.py, issue #42: the served path) and the gateway's
(a target that does not run the loop, a request with stop strings). The bidi-stream plumbing is
specserve/runtime/grpc_stream.py; the data plane is as gateway/remote.py describes for the target's client.

One ``RemoteDraftEndpoint`` per draft service address (one channel, shared by all requests);
``.session(deadline)`` gives the per-request ``RemoteDraft`` the spec loop drives. Failure contract: anything at
all (down, slower than its step timeout, stream broken) -> DraftError, and a block that does not even decode ->
MalformedDraft; the loop then goes on target-only.

Hidden rows in a shared buffer (gateway/remote.py): ``maps_hidden_of(target_info)`` says whether this
draft can map the target's buffers (it reads hidden rows, it lists the target's kind, both report the
same host); a session then starts with the buffer's handle and later proposals name row ranges. A draft
that cannot map one after all (FAILED_PRECONDITION) costs that request its speculation (target-only,
lossless), and the endpoint sends hidden rows as bytes from then on.

A draft is never sent a request's seed: a seeded request's StartSession carries ``derive_seed`` of it under
a key of the endpoint's own (its proposals stay reproducible, and nothing a draft is told relates to
the target's draws, which come from the target's own key: specserve/models/probs.py).

Circuit breaker (per draft endpoint): after ``breaker_failures`` timeouts / UNAVAILABLE in a row the
draft is not asked any more (every request goes target-only at once, releases are skipped: the draft
expires idle sessions itself) while a background probe calls its GetInfo every ``probe_every_s``
until it answers; then requests use it again.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from specserve.contract.speculation import MAX_K
from specserve.contract.types import (
    DraftBlock,
    SamplingParams,
    SharedRows,
)
from specserve.loop.clients import DraftError
from specserve.loop.step_loop import MalformedDraft
from specserve.models.probs import derive_seed, new_seed_key
from specserve.protos import convert
from specserve.protos.specserve.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
)
from specserve.runtime import tracing as tn
from specserve.runtime.data_plane import ShmClient, StatusFrame
from specserve.runtime.grpc_stream import RELEASE_TIMEOUT_S, BidiStream, Deadline
from specserve.runtime.hidden_share import host_id
from specserve.runtime.servers_common import TlsFiles, aio_channel, bearer_metadata
from specserve.runtime.shm_ring import PeerGone, RingTimeout

if TYPE_CHECKING:
    import torch

_DOWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


def draft_reply_limit(vocab_size: int) -> int:  # bytes
    """The largest reply the gateway reads from a draft, over gRPC and shared memory alike: q of the most
    nodes a request can ask for (MAX_K, a chain or a tree; + 1 for slack) over the
    target's vocabulary in float32, and 1 MiB for the rest. A longer one is refused before it is
    allocated (gRPC: RESOURCE_EXHAUSTED; the ring drops the channel), and that request goes target-only."""
    return (MAX_K + 1) * max(int(vocab_size), 1) * 4 + (1 << 20)


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 3  # timeouts / UNAVAILABLE in a row that open the breaker
    probe_every_s: float = 1.0  # while open: one GetInfo this often (and with this timeout)

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {self.failures}")
        if not self.probe_every_s > 0:
            raise ValueError(f"probe_every_s must be > 0, got {self.probe_every_s}")


class _Breaker:
    """Consecutive failures of one draft endpoint; open = do not ask it, probe it in the background."""

    def __init__(self, endpoint: RemoteDraftEndpoint, config: BreakerConfig) -> None:
        self.endpoint, self.config = endpoint, config
        self.consecutive = 0
        self.is_open = False
        self.opened = 0  # times it opened (for tests and logs)
        self._probe: asyncio.Task | None = None
        # the event loop the endpoint's channel lives on (None: the caller's): a failure seen by a loop on another
        # thread (the target's served loop on its engine's thread) starts the probe there
        self.loop: asyncio.AbstractEventLoop | None = None

    def succeeded(self) -> None:
        if not self.is_open:
            self.consecutive = 0

    def failed(self) -> None:
        self.consecutive += 1
        if self.is_open or self.consecutive < self.config.failures:
            return
        self.is_open = True
        self.opened += 1
        ep = self.endpoint
        print(
            f"{ep.who}: draft {ep.name} at {ep.address} failed {self.consecutive} times in a row; requests go "
            "target-only until it answers again",
            file=sys.stderr,
            flush=True,
        )
        here = asyncio.get_running_loop()
        if self.loop is None or self.loop is here:
            self._start_probe()
        else:
            self.loop.call_soon_threadsafe(self._start_probe)

    def _start_probe(self) -> None:
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_up(), name=f"probe-{self.endpoint.name}")

    async def _probe_until_up(self) -> None:
        every = self.config.probe_every_s
        while True:
            await asyncio.sleep(every)
            try:
                await self.endpoint.stub.GetInfo(
                    draft_pb2.DraftInfoRequest(), timeout=every, metadata=self.endpoint.auth
                )
            except grpc.aio.AioRpcError:
                continue
            self.is_open, self.consecutive = False, 0
            print(f"{self.endpoint.who}: draft {self.endpoint.name} answers again", file=sys.stderr, flush=True)
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            try:
                await self._probe
            except asyncio.CancelledError:
                pass


class RemoteDraftEndpoint:
    """A draft service at one address (one channel for every request)."""

    def __init__(
        self,
        name: str,
        address: str,
        step_timeout_s: float = 5.0,
        tls: TlsFiles | None = None,
        target_info: target_pb2.TargetInfo | None = None,
        trusted: bool = False,
        breaker: BreakerConfig | None = None,
        token: str | None = None,
        shm: bool = True,
        hidden_share: bool = True,
        who: str = "gateway",
    ) -> None:
        self.who = who  # the process whose loop calls it (its log lines' prefix)
        self.auth = bearer_metadata(token)  # sent on every call (the draft's --auth-token)
        self.shm = shm  # ask for the shared-memory data plane per session (used when it opens here)
        self.hidden_share = shm and hidden_share  # hand it the target's hidden-row buffers where it can map them
        self.name = name
        self.address = address
        self.trusted = trusted  # the operator trusts its q: verified with it (else proposal-only)
        self.breaker = _Breaker(self, breaker or BreakerConfig())
        self.step_timeout_s = step_timeout_s
        self.target_info = target_info  # set: a drafter for another vocabulary is never used
        # what a draft may send back: a drafted block's q at most (not the services' 512 MiB)
        self.reply_limit = draft_reply_limit(target_info.vocab_size if target_info is not None else 1 << 18)
        self.channel = aio_channel(address, tls, max_receive_bytes=self.reply_limit)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.last_info: draft_pb2.DraftInfo | None = None
        self._seed_key = new_seed_key()  # what a draft gets instead of a request's seed (derive_seed)
        self._host_id = host_id()

    def draft_sampling(self, sampling: SamplingParams):
        """The sampling a draft session is started with: the request's, its seed replaced by one derived
        under this endpoint's key (a draft never learns the user's seed)."""
        msg = convert.sampling_to_proto(sampling)
        if sampling.seed is not None:
            msg.seed = derive_seed(self._seed_key, sampling.seed)
        return msg

    async def fetch_info(self, timeout_s: float, wait_for_ready: bool = False) -> draft_pb2.DraftInfo:
        self.last_info = await self.stub.GetInfo(
            draft_pb2.DraftInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self.auth
        )
        return self.last_info

    def asks_shm(self) -> bool:
        """Ask for a session's channel only where it can be opened: the draft reports this host (or no host)."""
        reported = self.last_info.host_id if self.last_info is not None else ""
        return self.shm and (not reported or reported == self._host_id)

    def maps_hidden_of(self, target_info: target_pb2.TargetInfo | None) -> bool:
        """Whether this draft's sessions can read the target's hidden rows from a shared buffer (both say
        they run on the same host, the draft maps the target's kind); as its last GetInfo said."""
        info = self.last_info
        return bool(
            self.hidden_share
            and info is not None
            and target_info is not None
            and info.needs_hidden_states
            and target_info.hidden_share_kind
            and target_info.hidden_share_kind in info.hidden_share_kinds
            and target_info.host_id
            and target_info.host_id == info.host_id
        )

    def session(self, deadline: float | None, shm: bool = True) -> RemoteDraft:
        """``shm=False``: this session's steps go over gRPC whatever the endpoint allows (its caller's --no-shm)."""
        return RemoteDraft(self, deadline, shm)

    async def close(self) -> None:
        await self.breaker.close()
        await self.channel.close()


class RemoteDraft:
    """DraftClient for one request. Every failure is a DraftError: a draft never fails a request."""

    def __init__(self, endpoint: RemoteDraftEndpoint, deadline: float | None, shm: bool = True) -> None:
        self._ep = endpoint
        self._asks_shm = shm
        self._deadline = Deadline(deadline)
        self._stream = BidiStream(self._open_stream)
        self._shm: ShmClient | None = None  # this session's shared-memory channel, when it has one
        self._shm_broken = False  # the channel ended: proposals fail (as on a stream the draft ended)
        self.service_ms = 0.0  # draft time the draft service measured, summed over this session's proposals
        self.compute_ms = 0.0  # of which the proposer's own calls (the rest: the service's hop and encoding)

    @property
    def transport(self) -> str:
        """How this session's proposals travel: "shm" or "grpc"."""
        return "shm" if self._shm is not None else "grpc"

    @property
    def on_ring(self) -> bool:
        """Whether its proposals go over its shared-memory ring (or fail at once: the ring ended), which any event
        loop may wait on; else over the endpoint's gRPC channel, on the channel's loop."""
        return self._shm is not None or self._shm_broken

    def close_ring(self) -> None:
        """Close its ring, on the loop its proposals waited on (``release`` closes it too)."""
        if self._shm is not None:
            self._shm.close()
            self._shm, self._shm_broken = None, True

    def _timeout(self) -> float:
        if self._ep.breaker.is_open:
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: not answering (circuit open)")
        left = self._deadline.remaining(self._ep.step_timeout_s)
        if left <= 0:
            raise DraftError("no time left before the request's deadline")
        return left

    def _open_stream(self):
        return self._ep.stub.ProposeStream(metadata=tn.outgoing_metadata(self._ep.auth))

    async def _unary(self, method, request):
        try:
            resp = await method(request, timeout=self._timeout(), metadata=tn.outgoing_metadata(self._ep.auth))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _DOWN:
                self._ep.breaker.failed()
            shared = isinstance(request, draft_pb2.StartSessionRequest) and request.HasField("hidden_share")
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and shared:
                self._ep.hidden_share = False  # it cannot map the target's buffers: bytes from now on
                print(
                    f"{self._ep.who}: draft {self._ep.name} cannot map the target's hidden-row buffers "
                    f"({exc.details()}); its sessions get hidden rows as bytes",
                    file=sys.stderr,
                    flush=True,
                )
            raise DraftError(
                f"draft {self._ep.name} at {self._ep.address}: {exc.code().name}: {exc.details()}"
            ) from None
        except DraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {exc!r}") from None
        self._ep.breaker.succeeded()
        return resp

    async def info(self):
        info = await self._unary(self._ep.stub.GetInfo, draft_pb2.DraftInfoRequest())
        self._ep.last_info = info
        if self._ep.target_info is not None:
            problem = incompatible(info, self._ep.target_info)
            if problem:  # e.g. restarted with another model: this request goes on target-only
                raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {problem}")
        return info

    async def start(
        self, session_id: str, token_ids: Sequence[int], hidden: torch.Tensor | None, sampling: SamplingParams
    ) -> None:
        req = draft_pb2.StartSessionRequest(
            session_id=session_id,
            token_ids=list(token_ids),
            sampling=self._ep.draft_sampling(sampling),
            want_shm=self._asks_shm and self._ep.asks_shm(),
        )
        if isinstance(hidden, SharedRows):  # in the target's buffer: relay its handle and the range
            req.hidden_share.CopyFrom(hidden.handle)
            req.hidden_rows.start, req.hidden_rows.stop = hidden.start, hidden.stop
            hidden = hidden.tail
        if hidden is not None:
            req.hidden.CopyFrom(convert.tensor_to_proto(hidden))
        resp = await self._unary(self._ep.stub.StartSession, req)
        self._shm = await ShmClient.attach(resp.shm_channel, self._ep.reply_limit)

    async def propose(
        self,
        session_id: str,
        prefix_len: int,
        append_ids: Sequence[int],
        append_hidden: torch.Tensor | None,
        num_tokens: int,
        tree=None,
    ) -> DraftBlock:
        req = draft_pb2.ProposeRequest(
            session_id=session_id,
            prefix_len=prefix_len,
            append_ids=list(append_ids),
            num_tokens=num_tokens,
            trace_context=tn.current_trace_context(),
        )
        if isinstance(append_hidden, SharedRows):  # rows of the target's buffer (then those that came as bytes)
            req.append_rows.start, req.append_rows.stop = append_hidden.start, append_hidden.stop
            append_hidden = append_hidden.tail
        if append_hidden is not None:
            req.append_hidden.CopyFrom(convert.tensor_to_proto(append_hidden))
        if tree is not None:
            req.is_tree = True
            req.tree.CopyFrom(convert.tree_spec_to_proto(tree.num_nodes, tree.top_k, tree.depth))
        if self._shm is not None or self._shm_broken:
            resp = await self._propose_shm(req)
        else:
            resp = await self._propose_stream(req)
        self._ep.breaker.succeeded()
        self.service_ms += resp.timings.total_ms
        self.compute_ms += resp.timings.compute_ms
        try:
            return convert.draft_block_from_proto(resp.draft)
        except convert.ConversionError as exc:
            raise MalformedDraft(f"draft {self._ep.name}: {exc}") from None

    propose_ahead = propose  # block n+1 while block n is verified: a propose like any other

    async def _propose_shm(self, req):
        where = f"draft {self._ep.name} over shared memory"
        if self._shm is None:
            raise DraftError(f"{where}: the channel already ended")
        timeout = self._timeout()
        try:
            return await self._shm.exchange(req, draft_pb2.ProposeResponse, timeout)
        except StatusFrame as exc:
            if exc.code in _DOWN:
                self._ep.breaker.failed()
            raise DraftError(f"{where}: {exc.code.name}: {exc.details}") from None
        except RingTimeout:
            self._ep.breaker.failed()
            raise DraftError(f"{where}: no answer within {timeout:.3g} s") from None
        except PeerGone as exc:
            self._ep.breaker.failed()
            raise DraftError(f"{where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            raise DraftError(f"{where}: {exc!r}") from None
        finally:
            if self._shm is not None and self._shm.channel.closed:
                self._shm, self._shm_broken = None, True

    async def _propose_stream(self, req):
        try:
            return await self._stream.exchange(req, self._timeout())
        except DraftError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the draft only drops speculation
            self._stream.close()
            is_rpc = isinstance(exc, grpc.aio.AioRpcError)
            if isinstance(exc, asyncio.TimeoutError) or (is_rpc and exc.code() in _DOWN):
                self._ep.breaker.failed()
            what = f"{exc.code().name}: {exc.details()}" if is_rpc else repr(exc)
            raise DraftError(f"draft {self._ep.name} at {self._ep.address}: {what}") from None

    async def release(self, session_id: str) -> None:
        self._stream.close()
        if self._shm is not None:
            self._shm.close()  # the draft sees the channel end and releases the session
        if self._ep.breaker.is_open:
            return  # not answering: it frees the session when the stream ends or the session idles out
        await asyncio.shield(self._release(session_id))

    async def _release(self, session_id: str) -> None:
        try:
            await self._ep.stub.Release(
                draft_pb2.DraftReleaseRequest(session_id=session_id), timeout=RELEASE_TIMEOUT_S, metadata=self._ep.auth
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _DOWN:
                self._ep.breaker.failed()
            # the draft also frees a session when its propose stream ends


def incompatible(draft: draft_pb2.DraftInfo, target: target_pb2.TargetInfo) -> str:
    """Why a drafter cannot serve this target ("" when it can). The vocabulary rule of
    specserve/models/vocab.py: two tokenizer fingerprints must be equal, else the sizes
    (a vocabulary-agnostic drafter, size 0 and no fingerprint, fits every target)."""
    d_hash, t_hash = draft.vocab_hash, target.vocab_hash
    if d_hash.startswith("sha256:") and t_hash.startswith("sha256:"):
        if d_hash != t_hash:
            return f"drafter vocabulary {d_hash[:20]} differs from the target's {t_hash[:20]}"
    elif draft.vocab_size and target.vocab_size and draft.vocab_size != target.vocab_size:
        return f"drafter vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}"
    if draft.needs_hidden_states and any(not 0 <= layer <= target.num_layers for layer in draft.hidden_layers):
        return f"drafter reads target layers {list(draft.hidden_layers)} but the target has {target.num_layers}"
    return ""
