"""Careless and hostile clients and drafters over real processes on loopback (issues #19, #33).

One stack for the module: a target, an ngram draft, a `model` draft (the tiny target's own checkpoint
as its LM) and a gateway. Every test ends by checking that no session is left open on any service.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

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


SEED_KEY = "5eed" * 8  # the target's pinned SPECSERVE_SEED_KEY: only the negative control is given it
MIRROR_SAMPLING = dict(temperature=1.0, top_k=8)


class MirrorDraft(draft_pb2_grpc.DraftServiceServicer):
    """A hostile drafter that knows the target: the same checkpoint in this process, whose generator it
    replays from the seed it is told (StartSession's sampling), as the target draws it. At the first
    step it tries every one-token proposal against a copy of that generator and drafts one whose
    acceptance, or whose rejection's recovery draw, emits the lowest token id it can reach at position 1.
    ``key``/``told_seed`` (the negative control): the target's seed key and each request's own seed,
    given out of band, as a drafter that knew both would replay the target exactly."""

    def __init__(self, ckpt) -> None:
        from specserve.target_service.factory import EngineConfig, build_engine

        self.ckpt = ckpt
        self.engine = build_engine(EngineConfig(model=ckpt, num_kv_blocks=64))
        self.key: bytes | None = None
        self.told_seed: int | None = None
        self.in_sync = 0  # sessions whose first pending token the replay drew too
        self.aimed = 0  # first proposals chosen against the replayed generator

    def use_key(self, key: bytes | None) -> None:
        from specserve.target_service.factory import EngineConfig, build_engine

        self.key = key
        keyed = {} if key is None else {"seed_key": key}
        self.engine = build_engine(EngineConfig(model=self.ckpt, num_kv_blocks=64, **keyed))

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="mirror", vocab_size=256, max_block_size=4, has_probs=False)

    async def StartSession(self, request, context):
        from specserve.contract.types import SamplingParams

        sampling = convert.sampling_from_proto(request.sampling)
        seed = self.told_seed if self.key is not None else sampling.seed
        sid = request.session_id
        if self.engine.has_session(sid):
            self.engine.release(sid)
        ids = list(request.token_ids)
        self.engine.prefill(sid, ids[:-1], SamplingParams(sampling.temperature, sampling.top_p, sampling.top_k, seed))
        self.in_sync += self.engine.session(sid).pending_token == ids[-1]
        self.engine._get(sid).pending_token = ids[-1]  # what the target has: its draw, whether ours agreed or not
        return draft_pb2.StartSessionResponse(session_id=sid)

    def _aim(self, sid: str) -> int:
        from specserve.target_service.engine.sampler import verify_step_device
        from specserve.target_service.engine.tree import layout_of

        s = self.engine._get(sid)
        self.aimed += s.steps == 0
        row = self.engine.score_block(sid, DraftBlock(token_ids=(0,)))[:1]  # [1, V]: p at position 1
        logits = torch.cat([row, row])  # row 1 only feeds a bonus draw, after position 1 is decided
        from specserve.models.probs import target_probs

        p = target_probs(row, s.sampling)[0]
        # a token of p(x) = 0 is always rejected and recovers from p itself: one of them stands for all
        candidates = torch.nonzero(p).flatten().tolist() + [int(torch.nonzero(p == 0).flatten()[0])]
        best, pick = None, 0
        for x in candidates:
            gen = torch.Generator()
            gen.set_state(s.generator.get_state())
            block = DraftBlock(token_ids=(x,))
            last, nxt = verify_step_device(layout_of(block), torch.tensor([x]), logits, None, s.sampling, gen)
            emitted = x if int(last) == 1 else int(nxt)
            if best is None or emitted < best:
                best, pick = emitted, x
        return pick

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            x = self._aim(req.session_id) if self.engine.has_session(req.session_id) else 0
            block = convert.draft_block_to_proto(DraftBlock(token_ids=(x,) * max(1, req.num_tokens)))
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=block)

    async def Release(self, request, context):
        if self.engine.has_session(request.session_id):
            self.engine.release(request.session_id)
        return draft_pb2.DraftReleaseResponse(released=True)

    def exact_law(self, prompt: list[int]) -> dict[int, float]:
        """The target-only law of the token at position 1 (after the first pending token), exactly."""
        from specserve.contract.types import SamplingParams
        from specserve.models.probs import target_probs

        params = SamplingParams(**MIRROR_SAMPLING)
        e = self.engine
        e.prefill("law", prompt[:-1], SamplingParams())
        e._get("law").pending_token = prompt[-1]
        first = target_probs(e.score_block("law", DraftBlock(token_ids=(0,)))[:1], params)[0]
        law: dict[int, float] = {}
        for c in torch.nonzero(first).flatten().tolist():
            nxt = target_probs(e.score_block("law", DraftBlock(token_ids=(c,)))[1:], params)[0]
            for t in torch.nonzero(nxt).flatten().tolist():
                law[t] = law.get(t, 0.0) + float(first[c] * nxt[t])
        e.release("law")
        return law


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
        self.mirror = MirrorDraft(ckpt)
        hostile["mirror"] = f"unix:{socks}/mirror.sock"
        self.fakes.serve(draft_pb2_grpc.add_DraftServiceServicer_to_server, self.mirror, hostile["mirror"])
        self.rogues = {mode: RogueFrameDraft(mode) for mode in ("ring", "grpc")}
        for mode, rogue in self.rogues.items():
            hostile[f"rogue_{mode}"] = f"unix:{socks}/rogue_{mode}.sock"
            self.fakes.serve(draft_pb2_grpc.add_DraftServiceServicer_to_server, rogue, hostile[f"rogue_{mode}"])
        gateway_drafts = {**self.drafts, **hostile, "liar_trusted": hostile["liar"]}
        auth = ["--auth-token", TOKEN, "--grace-s", "1"]
        self.target = Proc("target", ["--model", str(ckpt), "--listen", self.target_addr, "--num-kv-blocks", "256",
                                      *auth], {**self.env, "SPECSERVE_SEED_KEY": SEED_KEY})
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


def _position_one(hostile, seeds, draft: str, tell: bool) -> Counter:
    """Counts of the token at position 1 over one seeded request per seed, drafted one token at a time.
    ``tell``: each request's seed is handed to the mirror out of band, so they go one at a time; else 8 at
    a time (each session's draws depend on its own seed only)."""

    def one(seed: int) -> int:
        request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=3, draft=draft, num_speculative_tokens=1)
        request.sampling.temperature = MIRROR_SAMPLING["temperature"]
        request.sampling.top_k = MIRROR_SAMPLING["top_k"]
        request.sampling.seed = seed
        if tell:
            hostile.mirror.told_seed = seed
        ids, final = hostile.generate(request)
        assert len(ids) == 3 and not final.stats.draft_fallback
        return ids[1]

    if tell:
        return Counter(one(seed) for seed in seeds)
    with ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(one, seeds))


def _fit_pvalue(counts: Counter, law: dict[int, float], min_expected: float = 5.0) -> float:
    """Pearson's chi-square of goodness of fit of the counts to the exact law (small bins pooled)."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    big = sorted(t for t, p in law.items() if p * n >= min_expected)
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [law[t] * n for t in big] + [n * (1 - sum(law[t] for t in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue)


def test_a_drafter_that_knows_the_seed_cannot_bias_seeded_sampling(hostile):
    """#33: a drafter that mirrors the target (its checkpoint, its sampler) and replays its generator
    from the seed it is told picks, at every request, the one-token proposal whose acceptance or
    recovery lands position 1 on the lowest id it can reach. 300 seeded requests through it follow the
    target's exact law at position 1 (chi-square goodness of fit): the target draws from an HMAC of
    the seed under its own key, and the gateway sends drafts a seed of its own derivation. Negative
    control: the same mirror given the target's key and each request's seed out of band replays the
    target's draws and biases position 1 past any doubt (150 requests, p < 1e-6)."""
    law = hostile.mirror.exact_law(PROMPT)
    hostile.mirror.use_key(None)
    aimed = hostile.mirror.aimed
    attacked = _position_one(hostile, range(300), "mirror", tell=False)
    assert hostile.mirror.aimed - aimed == 300
    p_attacked = _fit_pvalue(attacked, law)
    assert p_attacked > 1e-3, (p_attacked, attacked, law)
    hostile.mirror.use_key(bytes.fromhex(SEED_KEY))
    synced_before = hostile.mirror.in_sync
    control = _position_one(hostile, range(1000, 1150), "mirror", tell=True)
    assert hostile.mirror.in_sync - synced_before == 150  # it replayed every target draw
    p_control = _fit_pvalue(control, law)
    assert p_control < 1e-6, (p_control, control, law)
    hostile.wait_no_sessions()


def test_the_same_seed_gives_the_same_output_on_the_same_target(hostile):
    """What a seed guarantees (models/probs.py): the same seeded sampled request twice through the same
    target and draft gives the same tokens (drafted by the model draft, sampled too); another seed
    other tokens."""
    def run(seed: int) -> list[int]:
        request = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=24, draft="model",
                                              num_speculative_tokens=3)
        request.sampling.temperature, request.sampling.seed = 1.0, seed
        ids, final = hostile.generate(request)
        assert not final.stats.draft_fallback
        return ids

    first = run(5)
    assert run(5) == first and run(5) == first
    assert any(run(seed) != first for seed in (6, 7))
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
