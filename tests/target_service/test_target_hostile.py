"""The target service against careless and hostile callers (issue #19), in-process over a unix socket:
idle sessions expire, drafted probabilities are checked, bad bytes and huge inputs get short
INVALID_ARGUMENT messages."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from served import InProcessServer, assert_unparseable_bytes_refused

from specserve.contract.types import DraftBlock
from specserve.protos import convert
from specserve.protos.specserve.v1 import target_pb2, target_pb2_grpc
from specserve.runtime.servers_common import ServiceBinding
from specserve.target_service.engine_worker import EngineWorker, TargetLimits
from specserve.target_service.factory import EngineConfig, build_engine
from specserve.target_service.server import SERVICE_NAME, TargetServicer, add_target_to_server

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
IDLE_S = 0.6


class HostileTarget(InProcessServer):
    call_timeout_s = 30.0

    def __init__(self, cfg: EngineConfig, address: str, limits: TargetLimits) -> None:
        self.cfg, self.limits = cfg, limits
        super().__init__(address, target_pb2_grpc.TargetServiceStub, start_timeout_s=120)

    async def _build(self):
        worker = await EngineWorker.build(lambda: build_engine(self.cfg), limits=self.limits)
        worker.start()
        servicer = TargetServicer(worker, model_name="tiny")
        return worker, ServiceBinding(add_target_to_server, servicer, SERVICE_NAME)

    def active(self) -> int:
        return self.stub.GetStats(target_pb2.TargetStatsRequest(), timeout=10).active_sessions


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    cfg = EngineConfig(model=tiny_checkpoint("qwen3_moe"), num_kv_blocks=320, kv_block_size=4)
    s = HostileTarget(
        cfg, f"unix:{tmp_path_factory.mktemp('hsock')}/t.sock", TargetLimits(session_idle_timeout_s=IDLE_S)
    )
    yield s
    s.close()


def prefill(served, sid: str, temperature: float = 0.0):
    sampling = target_pb2.PrefillRequest().sampling
    sampling.temperature = temperature
    sampling.seed = 1
    return served.stub.Prefill(
        target_pb2.PrefillRequest(session_id=sid, prompt_ids=PROMPT, sampling=sampling), timeout=10
    )


def verify(served, sid: str, ids, probs=None):
    block = convert.draft_block_to_proto(DraftBlock(token_ids=tuple(ids), probs=probs))
    return served.stub.Verify(target_pb2.VerifyRequest(session_id=sid, draft=block), timeout=10)


def test_an_idle_session_expires_and_a_busy_one_stays(served):
    """A session nobody calls is released after the idle timeout; one verified now and then is kept."""
    prefill(served, "idle")
    prefill(served, "busy")
    t_end = time.monotonic() + 4 * IDLE_S
    while time.monotonic() < t_end:
        verify(served, "busy", [])
        time.sleep(IDLE_S / 4)
    with pytest.raises(grpc.RpcError) as info:
        verify(served, "idle", [])
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert served.active() == 1
    assert served.stub.Release(target_pb2.ReleaseRequest(session_id="busy"), timeout=10).released
    assert served.active() == 0


def test_drafted_probabilities_that_could_force_tokens_are_refused(served):
    """q must be a distribution that gives each drafted token q(x) > 0: q(x) = 0 would make
    min(1, p/q) accept x whatever p says. Refused blocks leave the session usable."""
    prefill(served, "q", temperature=1.0)
    one_hot_other = torch.zeros(2, 256)
    one_hot_other[:, 8] = 1.0  # drafted 7, 7 with q(7) = 0
    half = torch.full((2, 256), 0.5 / 256)
    for bad in (one_hot_other, torch.zeros(2, 256), half):
        with pytest.raises(grpc.RpcError) as info:
            verify(served, "q", [7, 7], bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "probs" in info.value.details()
    honest = torch.full((2, 256), 1 / 256)
    assert verify(served, "q", [7, 7], honest).num_drafted == 2
    served.stub.Release(target_pb2.ReleaseRequest(session_id="q"), timeout=10)


@pytest.mark.parametrize("t", [1e-38, 1e-40, 1e-45])
def test_tiny_temperatures_decode_as_greedy(served, t):
    """Valid temperatures too small for float32 logits decode (never INTERNAL), as greedy does."""
    greedy = prefill(served, "g").next_token
    tiny = prefill(served, "t", temperature=t).next_token
    assert tiny == greedy
    assert verify(served, "t", [1, 2]).num_drafted == 2
    for sid in ("g", "t"):
        served.stub.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=10)


def test_unparseable_bytes_and_huge_inputs_get_short_invalid_argument(served):
    """Bytes that are no request get INVALID_ARGUMENT (gRPC alone says UNKNOWN), on unary and stream
    methods; a Prefill naming 10,000 hidden layers gets INVALID_ARGUMENT with a short message (an echo
    of the whole input would pass the 16 KB metadata limit and turn into RESOURCE_EXHAUSTED)."""
    assert_unparseable_bytes_refused(
        served.channel, "specserve.v1.TargetService", ("Prefill", "Verify", "Release"), "VerifyStream"
    )
    req = target_pb2.PrefillRequest(session_id="h", prompt_ids=PROMPT, hidden_layers=list(range(100, 10_100)))
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Prefill(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(info.value.details()) < 1200
    assert served.active() == 0


@pytest.mark.parametrize(
    "setting,value",
    [("temperature", float("inf")), ("temperature", float("nan")), ("top_p", float("inf")), ("top_p", float("nan"))],
)
def test_non_finite_sampling_is_refused_by_the_target_itself(served, setting, value):
    """A direct gRPC caller (no gateway before it) gets the gateway's refusal: the contract's SamplingParams
    is the one check (issue #44; before, temperature = inf passed ``not t >= 0`` and the session opened)."""
    request = target_pb2.PrefillRequest(session_id="inf", prompt_ids=PROMPT)
    setattr(request.sampling, setting, value)
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Prefill(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{setting}: must be" in info.value.details()
    assert served.active() == 0
