"""The draft service against careless and hostile callers (issue #19), in-process over a unix socket:
a session limit, a token budget over all sessions, idle expiry, bounded tree parameters."""

from __future__ import annotations

import time

import grpc
import pytest
from served import InProcessServer, assert_unparseable_bytes_refused

from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_worker import DrafterWorker, DraftLimits
from specserve.draft_service.registry import build_proposer
from specserve.draft_service.server import SERVICE_NAME, DraftServicer, add_draft_to_server
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc
from specserve.runtime.servers_common import ServiceBinding

IDLE_S = 0.6
LIMITS = DraftLimits(
    max_sessions=3, max_total_tokens=60, session_idle_timeout_s=IDLE_S, max_tree_top_k=4, propose_budget_s=0.5
)


class HostileDraft(InProcessServer):
    def __init__(self, address: str, config: DrafterConfig) -> None:
        self.config = config
        super().__init__(address, draft_pb2_grpc.DraftServiceStub, start_timeout_s=120)

    async def _build(self):
        worker = await DrafterWorker.build(lambda: build_proposer(self.config), limits=LIMITS)
        worker.start_expiry()
        return worker, ServiceBinding(add_draft_to_server, DraftServicer(worker), SERVICE_NAME)

    def active(self) -> int:
        return self.stub.GetStats(draft_pb2.DraftStatsRequest(), timeout=10).active_sessions

    def start(self, sid: str, n: int) -> None:
        self.stub.StartSession(
            draft_pb2.StartSessionRequest(session_id=sid, token_ids=[1 + i % 50 for i in range(n)]), timeout=10
        )

    def release_all(self, sids) -> None:
        for sid in sids:
            self.stub.Release(draft_pb2.DraftReleaseRequest(session_id=sid), timeout=10)


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    cfg = DrafterConfig(family="model", checkpoint=tiny_ckpt("draft_llama"), target_checkpoint=tiny_ckpt("target_moe"))
    s = HostileDraft(f"unix:{tmp_path_factory.mktemp('dhsock')}/d.sock", cfg)
    yield s
    s.close()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert len(info.value.details()) < 1000
    return info.value.code()


def test_sessions_beyond_the_limit_are_refused(served):
    for i in range(3):
        served.start(f"s{i}", 5)
    assert code_of(lambda: served.start("s3", 5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    served.release_all([f"s{i}" for i in range(3)])
    served.start("s3", 5)  # room again
    served.release_all(["s3"])
    assert served.active() == 0


def test_tokens_beyond_the_budget_are_refused_at_start_and_at_propose(served):
    assert code_of(lambda: served.start("big", 61)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    served.start("a", 40)
    assert code_of(lambda: served.start("b", 30)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    grow = draft_pb2.ProposeRequest(session_id="a", prefix_len=40, append_ids=[1] * 21, num_tokens=2)
    assert code_of(lambda: served.stub.Propose(grow, timeout=10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    ok = draft_pb2.ProposeRequest(session_id="a", prefix_len=40, append_ids=[1] * 5, num_tokens=2)
    assert len(served.stub.Propose(ok, timeout=10).draft.token_ids) == 2
    served.release_all(["a"])
    assert served.active() == 0


def test_tree_parameters_are_bounded(served):
    served.start("t", 5)
    huge = draft_pb2.ProposeRequest(
        session_id="t",
        prefix_len=5,
        num_tokens=0,
        is_tree=True,
        tree=draft_pb2.TreeSpec(num_nodes=8, top_k=1000000, depth=2),
    )
    t0 = time.monotonic()
    assert code_of(lambda: served.stub.Propose(huge, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - t0 < 2.0
    fine = draft_pb2.ProposeRequest(
        session_id="t", prefix_len=5, num_tokens=0, is_tree=True, tree=draft_pb2.TreeSpec(num_nodes=8, top_k=4, depth=2)
    )
    assert 1 <= len(served.stub.Propose(fine, timeout=10).draft.token_ids) <= 8
    served.release_all(["t"])


def test_an_idle_session_expires_and_a_busy_one_stays(served):
    served.start("idle", 5)
    served.start("busy", 5)
    t_end = time.monotonic() + 4 * IDLE_S
    n = 5
    while time.monotonic() < t_end:
        req = draft_pb2.ProposeRequest(session_id="busy", prefix_len=n, append_ids=[2], num_tokens=1)
        served.stub.Propose(req, timeout=10)
        n += 1
        time.sleep(IDLE_S / 4)
    assert served.active() == 1
    stale = draft_pb2.ProposeRequest(session_id="idle", prefix_len=5, num_tokens=1)
    assert code_of(lambda: served.stub.Propose(stale, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    served.release_all(["busy"])
    assert served.active() == 0


def test_unparseable_bytes_get_invalid_argument(served):
    assert_unparseable_bytes_refused(
        served.channel, "specserve.v1.DraftService", ("StartSession", "Propose", "Release"), "ProposeStream"
    )
    huge = draft_pb2.ProposeRequest(session_id="x" * 20_000, num_tokens=2)  # echoed in "not open"
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Propose(huge, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(info.value.details()) < 1200


def test_a_proposal_that_waited_past_its_budget_is_dropped(served):
    """While the drafter thread is busy (1.5 s of other work), a proposal waiting longer than the
    0.5 s budget gets DEADLINE_EXCEEDED instead of running late; the next one is served."""
    import asyncio

    served.start("late", 5)
    busy = asyncio.run_coroutine_threadsafe(served.worker.call(time.sleep, 1.5), served.loop)
    time.sleep(0.1)
    req = draft_pb2.ProposeRequest(session_id="late", prefix_len=5, num_tokens=2)
    assert code_of(lambda: served.stub.Propose(req, timeout=10)) == grpc.StatusCode.DEADLINE_EXCEEDED
    busy.result(10)
    assert len(served.stub.Propose(req, timeout=10).draft.token_ids) == 2
    served.release_all(["late"])


def test_infinite_temperature_is_refused_by_the_draft_itself(served):
    """The same refusal as the gateway's and the target's (the contract's SamplingParams, issue #44)."""
    request = draft_pb2.StartSessionRequest(session_id="inf", token_ids=[1, 2, 3])
    request.sampling.temperature = float("inf")
    with pytest.raises(grpc.RpcError) as info:
        served.stub.StartSession(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.temperature: must be a finite number >= 0" in info.value.details()
    assert served.active() == 0
