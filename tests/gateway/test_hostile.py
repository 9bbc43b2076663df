"""Careless and hostile clients and drafters over real processes on loopback (issues #19, #33).

One stack for the module: a target, an ngram draft, a `model` draft (the tiny target's own checkpoint
as its LM) and a gateway. Every test ends by checking that no session is left open on any service.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import torch
from service_helpers import BackgroundServer, Proc, base_env

from specserve.contract.types import DraftBlock
from specserve.protos import convert
from specserve.protos.specserve.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.servers_common import channel_options
from specserve.runtime.shm_ring import ShmChannel

PROMPT = [(5 * j + 1) % 256 for j in range(12)]
TOKEN = "services-secret"  # the target's and drafts' --auth-token; the gateway sends it downstream
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FORCED = 200  # the token a hostile drafter tries to force


class ForcingDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter: always drafts FORCED, with a q that makes min(1, p/q) accept it.
    ``zero``: q one-hot on another token (q(FORCED) = 0, refused by the checks);
    ``liar``: q(FORCED) = 1e-6, the rest spread evenly (a valid distribution that lies)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="forcer", vocab_size=256, max_block_size=4, has_probs=True)

    async def StartSession(self, request, context):
        return draft_pb2.StartSessionResponse(session_id=request.session_id)

    def _block(self, k: int) -> DraftBlock:
        q = torch.zeros(k, 256)
        if self.mode == "zero":
            q[:, FORCED + 1] = 1.0
        else:
            q[:] = (1 - 1e-6) / 255
            q[:, FORCED] = 1e-6
        return DraftBlock(token_ids=(FORCED,) * k, probs=q)

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            block = convert.draft_block_to_proto(self._block(req.num_tokens))
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        return draft_pb2.DraftReleaseResponse(released=True)


class RogueFrameDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter aimed at the gateway's memory. ``ring``: it offers a shared-memory channel and
    answers the first proposal with a bare 4-byte length prefix saying 2^31 bytes (before #33 the
    gateway committed 2 GiB for it, and kept it); ``grpc``: it answers over the stream with a
    ProposeResponse of 8 MiB of q (the gateway's draft channels took 512 MiB)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.frames_sent = 0
        self._channels: list[ShmChannel] = []

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="rogue", vocab_size=256, max_block_size=8, has_probs=True)

    async def StartSession(self, request, context):
        name = ""
        if self.mode == "ring" and request.want_shm:
            channel = ShmChannel.create()
            self._channels.append(channel)
            asyncio.get_running_loop().create_task(self._rogue(channel))
            name = channel.name
        return draft_pb2.StartSessionResponse(session_id=request.session_id, shm_channel=name)

    async def _rogue(self, channel: ShmChannel) -> None:
        try:
            await channel.wait_attached(10)
            await channel.arecv(10)  # the first ProposeRequest
            channel._write_some([memoryview((1 << 31).to_bytes(4, "little"))], 0)  # the prefix, never a body
            channel._ring_peer()
            self.frames_sent += 1
            await asyncio.sleep(5)
        except Exception:  # noqa: BLE001 - the gateway dropped the channel
            pass
        finally:
            channel.close()

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            q = torch.full((8 * 1024, 256), 1 / 256)  # 8 MiB of a valid-looking q
            block = convert.draft_block_to_proto(DraftBlock(token_ids=(1,) * q.shape[0], probs=q))
            self.frames_sent += 1
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        return draft_pb2.DraftReleaseResponse(released=True)


class HostileStack:
    def __init__(self, ckpt, socks) -> None:
        self.env = base_env()
        self.closed = False
        self.target_addr = f"unix:{socks}/t.sock"
        self.drafts = {"ngram": f"unix:{socks}/ngram.sock", "model": f"unix:{socks}/model.sock"}
        self.fakes = BackgroundServer()  # hostile drafters, served from the test process
        hostile = {"zero": f"unix:{socks}/zero.sock", "liar": f"unix:{socks}/liar.sock"}
        for mode, addr in hostile.items():
            self.fakes.serve(draft_pb2_grpc.add_DraftServiceServicer_to_server, ForcingDraft(mode), addr)
        self.rogues = {mode: RogueFrameDraft(mode) for mode in ("ring", "grpc")}
        for mode, rogue in self.rogues.items():
            hostile[f"rogue_{mode}"] = f"unix:{socks}/rogue_{mode}.sock"
            self.fakes.serve(draft_pb2_grpc.add_DraftServiceServicer_to_server, rogue, hostile[f"rogue_{mode}"])
        gateway_drafts = {**self.drafts, **hostile, "liar_trusted": hostile["liar"]}
        auth = ["--auth-token", TOKEN, "--grace-s", "1"]
        self.target = Proc("target", ["--model", str(ckpt), "--listen", self.target_addr, "--num-kv-blocks", "256",
                                      *auth], self.env)
        self.draft_procs = {
            "ngram": Proc("draft", ["--draft", "ngram", "--model", str(ckpt), "--listen", self.drafts["ngram"], *auth],
                          self.env),
            "model": Proc("draft", ["--draft", "model", "--draft-model", str(ckpt), "--model", str(ckpt),
                                    "--listen", self.drafts["model"], *auth], self.env),
        }
        self.gateway = Proc(
            "gateway",
            ["--target", self.target_addr, *[a for n, addr in gateway_drafts.items() for a in ("--draft-service", f"{n}={addr}")],
             "--port", "0", "--draft-step-timeout-s", "1", "--trust-draft-probs", "liar_trusted",
             "--draft-breaker-failures", "2", "--downstream-auth-token", TOKEN, "--grace-s", "1"],
            self.env,
        )
        self.gateway_addr = self.gateway.wait_line("gateway listening on ", timeout=180).split()[-1]
        for name, proc in self.draft_procs.items():
            proc.wait_line(f"draft ({name}) listening on ", timeout=180)

    def open_sessions(self) -> dict[str, int]:
        out = {}
        with grpc.insecure_channel(self.target_addr) as ch:
            out["target"] = target_pb2_grpc.TargetServiceStub(ch).GetStats(
                target_pb2.TargetStatsRequest(), timeout=5, metadata=AUTH).active_sessions
        for name, addr in self.drafts.items():
            with grpc.insecure_channel(addr) as ch:
                out[name] = draft_pb2_grpc.DraftServiceStub(ch).GetStats(
                    draft_pb2.DraftStatsRequest(), timeout=5, metadata=AUTH).active_sessions
        return out

    def wait_no_sessions(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = self.open_sessions()
            if not any(left.values()):
                return
            assert time.monotonic() < deadline, f"sessions left open: {left}"
            time.sleep(0.1)

    def generate(self, request) -> tuple[list[int], gateway_pb2.FinalMessage]:
        with grpc.insecure_channel(self.gateway_addr, options=channel_options()) as ch:
            result = gateway_pb2_grpc.GatewayStub(ch).GenerateUnary(request, timeout=60)
        return list(result.token_ids), result.final

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in (self.gateway, *self.draft_procs.values(), self.target):
            p.stop()
        self.fakes.close()


@pytest.fixture(scope="module")
def hostile(tiny_target_dir, tmp_path_factory):
    s = HostileStack(tiny_target_dir, tmp_path_factory.mktemp("hostile"))
    yield s
    s.close()


async def _hang_up_after_final(address: str, request: gateway_pb2.GenerateRequest) -> bool:
    """Read until the final message, then close the channel at once (as `specserve client` does)."""
    channel = grpc.aio.insecure_channel(address, options=channel_options())
    try:
        async for msg in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=60):
            if msg.HasField("final"):
                return True
        return False
    finally:
        await channel.close()


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_clients_that_hang_up_after_the_final_message_leave_no_session(hostile, draft):
    """20 clients close their channel right after the final message: no target or draft session stays
    open (the gateway's release runs however the request's generator is ended)."""
    request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=8, draft=draft, num_speculative_tokens=4)

    async def many():
        return await asyncio.gather(*[_hang_up_after_final(hostile.gateway_addr, request) for _ in range(20)])

    assert all(asyncio.run(many()))
    hostile.wait_no_sessions(timeout=3.0)
    noise = [line for line in hostile.gateway.lines if "Traceback" in line or "Failed to detach" in line]
    assert not noise, noise[:3]


def test_target_and_drafts_refuse_calls_without_the_token(hostile):
    """With --auth-token, a client without it cannot drive the target or a draft directly (health
    stays open); the gateway's --downstream-auth-token gets requests served, drafted."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    calls = [
        (hostile.target_addr, lambda ch, md: target_pb2_grpc.TargetServiceStub(ch).Prefill(
            target_pb2.PrefillRequest(session_id="intruder", prompt_ids=[1, 2]), timeout=5, metadata=md)),
        (hostile.drafts["ngram"], lambda ch, md: draft_pb2_grpc.DraftServiceStub(ch).StartSession(
            draft_pb2.StartSessionRequest(session_id="intruder", token_ids=[1, 2]), timeout=5, metadata=md)),
        (hostile.drafts["model"], lambda ch, md: next(iter(draft_pb2_grpc.DraftServiceStub(ch).ProposeStream(
            iter([draft_pb2.ProposeRequest(session_id="intruder", num_tokens=2)]), timeout=5, metadata=md)))),
    ]
    for address, call in calls:
        with grpc.insecure_channel(address) as ch:
            for md in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as info:
                    call(ch, md)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ok = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert ok.status == health_pb2.HealthCheckResponse.SERVING
    for draft in ("ngram", "model"):
        ids, final = hostile.generate(gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=8, draft=draft))
        assert len(ids) == 8 and not final.stats.draft_fallback
    hostile.wait_no_sessions()


def _forced_share(hostile, draft: str) -> tuple[float, bool]:
    """Share of FORCED among the tokens of sampled requests drafted by ``draft``; any fallback."""
    ids, fallback = [], False
    for seed in range(4):
        request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=24, draft=draft,
                                              num_speculative_tokens=4)
        request.sampling.temperature = 1.0
        request.sampling.seed = seed
        got, final = hostile.generate(request)
        ids += got
        fallback |= final.stats.draft_fallback
    return ids.count(FORCED) / len(ids), fallback


def test_a_drafter_cannot_force_tokens_under_sampling(hostile):
    """q(x) = 0 for the drafted token is refused (the request goes target-only); a q that lies within
    the rules cannot force tokens either, because an untrusted draft is verified proposal-only. The
    negative control: the same liar marked trusted (--trust-draft-probs) does force its token, so the
    measure can tell."""
    share, fallback = _forced_share(hostile, "zero")
    assert share < 0.2 and fallback
    share, fallback = _forced_share(hostile, "liar")
    assert share < 0.2 and not fallback
    share, _ = _forced_share(hostile, "liar_trusted")
    assert share > 0.5
    hostile.wait_no_sessions()


def test_a_frozen_draft_trips_the_breaker_then_is_used_again(hostile):
    """A frozen draft (SIGSTOP) costs the first request its step and release timeouts; after two
    timeouts in a row the gateway stops asking it (requests go target-only at once) and probes it;
    once it runs again (SIGCONT), requests use it again."""
    request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=8, draft="ngram", num_speculative_tokens=4)
    base, _ = hostile.generate(gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=8, draft="none"))
    pid = hostile.draft_procs["ngram"].popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            ids, final = hostile.generate(request)
            took.append(time.monotonic() - t0)
            assert ids == base and final.stats.draft_fallback
        assert took[0] > 0.9 and max(took[1:]) < 0.5, took
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while True:
        ids, final = hostile.generate(request)
        assert ids == base
        if not final.stats.draft_fallback:
            break
        assert time.monotonic() < deadline, "the draft was not used again after it came back"
        time.sleep(0.2)
    hostile.wait_no_sessions()


def _rss_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


@pytest.mark.parametrize("mode", ["ring", "grpc"])
def test_a_rogue_drafters_oversized_frame_costs_the_gateway_no_memory_and_falls_back(hostile, mode):
    """#33: six concurrent requests through a drafter whose reply claims 2^31 bytes on the ring (or
    sends 8 MiB over gRPC, past what any block's q needs): the gateway's peak RSS grows by less than
    16 MB, every request falls back to target-only with the target-only tokens, and nothing stays open."""
    base, _ = hostile.generate(gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=12, draft="none"))
    request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=12, draft=f"rogue_{mode}",
                                          num_speculative_tokens=4)
    hostile.generate(request)  # warm: the gateway's own first-use allocations are not the rogue's
    pid = hostile.gateway.popen.pid
    before = _rss_kb(pid)
    sent = hostile.rogues[mode].frames_sent

    async def six():
        channel = grpc.aio.insecure_channel(hostile.gateway_addr, options=channel_options())
        try:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            return await asyncio.gather(*[stub.GenerateUnary(request, timeout=60) for _ in range(6)])
        finally:
            await channel.close()

    results = asyncio.run(six())
    after = _rss_kb(pid)
    grew_mb = (after["VmHWM"] - before["VmRSS"]) / 1024
    assert grew_mb < 16, (before, after)
    assert hostile.rogues[mode].frames_sent >= sent + 6
    for result in results:
        assert list(result.token_ids) == base and result.final.stats.draft_fallback
    hostile.wait_no_sessions()


def test_a_stop_with_sessions_open_is_quiet(hostile):
    """Last (it stops the stack): SIGTERM with a target session whose verify stream is still open, a
    draft session and a request streaming through the gateway. Every process ends cleanly and prints
    no traceback, no "Task exception was never retrieved", no "Failed to detach context"."""
    import threading

    target_ch = grpc.insecure_channel(hostile.target_addr)
    target = target_pb2_grpc.TargetServiceStub(target_ch)
    target.Prefill(target_pb2.PrefillRequest(session_id="left", prompt_ids=PROMPT), timeout=10, metadata=AUTH)
    hold = threading.Event()

    def one_verify_then_wait():
        yield target_pb2.VerifyRequest(session_id="left")
        hold.wait(30)

    stream = target.VerifyStream(one_verify_then_wait(), metadata=AUTH)
    next(stream)
    with grpc.insecure_channel(hostile.drafts["model"]) as ch:
        draft_pb2_grpc.DraftServiceStub(ch).StartSession(
            draft_pb2.StartSessionRequest(session_id="left", token_ids=PROMPT), timeout=10, metadata=AUTH)
    gw_ch = grpc.insecure_channel(hostile.gateway_addr)
    call = gateway_pb2_grpc.GatewayStub(gw_ch).Generate(
        gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=150, draft="model"), timeout=60)
    next(call)
    assert hostile.open_sessions()["target"] == 2
    try:
        hostile.close()
    finally:
        hold.set()
        target_ch.close()
        gw_ch.close()
    for proc in (hostile.gateway, *hostile.draft_procs.values(), hostile.target):
        assert proc.popen.returncode == 0, (proc.role, proc.lines[-20:])
        noise = [line for line in proc.lines
                 if any(word in line for word in ("Traceback", "never retrieved", "Failed to detach", "Error"))]
        assert not noise, (proc.role, noise[:5])
