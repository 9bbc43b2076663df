"""The draft gRPC service in-process (real n-gram proposer, real gRPC over a unix socket) against a
second proposer driven directly with the same calls."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from served import InProcessServer

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_worker import DrafterWorker
from specserve.draft_service.registry import build_proposer
from specserve.draft_service.server import SERVICE_NAME, DraftServicer, add_draft_to_server
from specserve.protos import convert
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc
from specserve.runtime.servers_common import ServiceBinding

CONFIG = DrafterConfig(family="ngram", max_block_size=6)
SEQ = [4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 23]


class ServedDraft(InProcessServer):
    def __init__(self, address: str) -> None:
        super().__init__(address, draft_pb2_grpc.DraftServiceStub)

    async def _build(self):
        worker = await DrafterWorker.build(lambda: build_proposer(CONFIG))
        return worker, ServiceBinding(add_draft_to_server, DraftServicer(worker), SERVICE_NAME)

    def stats(self) -> draft_pb2.DraftStats:
        return self.stub.GetStats(draft_pb2.DraftStatsRequest(), timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = ServedDraft(f"unix:{tmp_path_factory.mktemp('dsock')}/d.sock")
    yield s
    s.close()


def test_info_and_health(served):
    info = served.stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)
    local = build_proposer(CONFIG).info
    assert (info.family, info.max_block_size, info.needs_hidden_states, info.supports_tree) == (
        local.family,
        local.max_block_size,
        local.needs_hidden_states,
        local.supports_tree,
    )
    health = health_pb2_grpc.HealthStub(served.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == 1


def test_stream_matches_local_proposer(served):
    local = build_proposer(CONFIG)
    local.start("s", SEQ, None, SamplingParams())
    served.stub.StartSession(draft_pb2.StartSessionRequest(session_id="s", token_ids=SEQ), timeout=10)
    # (prefix_len, append_ids, k): confirm, extend, and roll back what was speculated
    steps = [(len(SEQ), [], 4), (len(SEQ), [42, 4], 3), (len(SEQ) + 1, [7], 5), (len(SEQ) + 2, [], 2)]
    reqs = iter(
        [draft_pb2.ProposeRequest(session_id="s", prefix_len=p, append_ids=a, num_tokens=k) for p, a, k in steps]
    )
    for (p, a, k), resp in zip(steps, served.stub.ProposeStream(reqs, timeout=30)):
        want = local.propose("s", p, a, None, k)
        got = convert.draft_block_from_proto(resp.draft)
        assert got.token_ids == want.token_ids and got.parents == want.parents
        assert resp.timings.total_ms > 0
    assert served.stats().proposals >= len(steps)
    deadline = time.monotonic() + 2  # the stream ended: its session is released
    while served.stats().active_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.stats().active_sessions == 0


def test_errors_are_invalid_argument(served):
    stub = served.stub
    with pytest.raises(grpc.RpcError) as info:
        stub.Propose(draft_pb2.ProposeRequest(session_id="nope", prefix_len=1, num_tokens=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.StartSession(draft_pb2.StartSessionRequest(session_id="e"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in info.value.details()
    stub.StartSession(draft_pb2.StartSessionRequest(session_id="e", token_ids=SEQ), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        stub.Propose(
            draft_pb2.ProposeRequest(
                session_id="e",
                prefix_len=len(SEQ),
                num_tokens=2,
                is_tree=True,
                tree=draft_pb2.TreeSpec(num_nodes=0, top_k=1, depth=1),
            ),
            timeout=10,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree" in info.value.details()
    ok = stub.Propose(draft_pb2.ProposeRequest(session_id="e", prefix_len=len(SEQ), num_tokens=2), timeout=10)
    assert len(ok.draft.token_ids) <= 2
    assert stub.Release(draft_pb2.DraftReleaseRequest(session_id="e"), timeout=10).released
    assert served.stats().active_sessions == 0
