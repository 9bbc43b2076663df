"""Peers that shrink shared memory under us, and refusals that leave it mapped (issue #44), over real processes.

One stack for the module: the demo target, an EAGLE-3 draft service (it reads the target's hidden rows from a
shared buffer), the soak's ring-shrinking rogue drafter (specserve/bench/soak_hostile.py) served from this process,
and a gateway over them.
- A draft that truncates its ring under the gateway cannot kill it: a stream beside it finishes.
- A local process that hands the EAGLE-3 draft a segment of its own and truncates it cannot kill the draft.
- A Prefill the engine refuses leaves no segment mapped in the target process, whatever the refusal.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

import grpc
import pytest
from service_helpers import Proc, base_env, wait_until
from shm_helpers import mapped_segments

from specserve.bench.soak_hostile import RogueDraft
from specserve.paths import demo_checkpoint
from specserve.protos.specserve.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2
from specserve.protos.specserve.v1 import target_pb2_grpc as target_grpc
from specserve.protos.specserve.v1.common_pb2 import HiddenShare
from specserve.runtime.servers_common import channel_options
from specserve.runtime.shm_layout import SHM_DIR, leftover_names

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")

PROMPT = [(7 * j + 3) % 200 + 10 for j in range(12)]


class ShmStack:
    def __init__(self, socks) -> None:
        env = base_env()
        self.before = set(leftover_names())
        target_dir = demo_checkpoint("target")
        self.target_addr = f"unix:{socks}/t.sock"
        self.eagle3_addr = f"unix:{socks}/eagle3.sock"
        shrink_addr = f"unix:{socks}/shrink.sock"
        self.shrinker = RogueDraft(shrink_addr, attack="shrink")
        self.target = Proc("target", ["--model", str(target_dir), "--listen", self.target_addr], env)
        self.eagle3 = Proc(
            "draft",
            [
                "--draft",
                "eagle3",
                "--draft-model",
                str(demo_checkpoint("eagle3")),
                "--model",
                str(target_dir),
                "--listen",
                self.eagle3_addr,
            ],
            env,
        )
        self.gateway = Proc(
            "gateway",
            [
                "--target",
                self.target_addr,
                "--port",
                "0",
                "--draft-step-timeout-s",
                "2",
                "--draft-service",
                f"eagle3={self.eagle3_addr}",
                "--draft-service",
                f"shrink={shrink_addr}",
            ],
            env,
        )
        self.gateway_addr = self.gateway.wait_line("gateway listening on ", timeout=300).split()[-1]
        self.eagle3.wait_line("draft (eagle3) listening on ", timeout=300)
        self.target_ch = grpc.insecure_channel(self.target_addr)
        self.draft_ch = grpc.insecure_channel(self.eagle3_addr)
        self.target_stub = target_grpc.TargetServiceStub(self.target_ch)
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_ch)

    def new_names(self) -> set[str]:
        return set(leftover_names()) - self.before

    def close(self) -> None:
        self.target_ch.close()
        self.draft_ch.close()
        for p in (self.gateway, self.eagle3, self.target):
            p.stop()
        self.shrinker.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = ShmStack(tmp_path_factory.mktemp("shm44"))
    yield s
    s.close()


def _generate(addr: str, request) -> tuple[list[int], gateway_pb2.FinalMessage]:
    with grpc.insecure_channel(addr, options=channel_options()) as ch:
        result = gateway_pb2_grpc.GatewayStub(ch).GenerateUnary(request, timeout=120)
    return list(result.token_ids), result.final


def test_a_draft_that_shrinks_its_ring_cannot_kill_the_gateway(stack):
    """The draft offers its ring, the gateway attaches and sends a proposal, the draft truncates the segment to 0
    bytes and rings: the gateway stays up (before: SIGBUS, every stream cut; a target-only stream got UNAVAILABLE),
    a target-only stream running meanwhile gets all its tokens, and the drafted requests fall back to target-only
    with the target-only tokens."""
    long_req = gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=96, draft="none")
    long_base, _ = _generate(stack.gateway_addr, long_req)
    short = gateway_pb2.GenerateRequest(
        prompt_ids=PROMPT[:8], max_new_tokens=8, draft="shrink", num_speculative_tokens=4
    )
    short_base, _ = _generate(
        stack.gateway_addr, gateway_pb2.GenerateRequest(prompt_ids=PROMPT[:8], max_new_tokens=8, draft="none")
    )
    attacks = stack.shrinker.shrinks_refused + stack.shrinker.shrunk
    streamed: list[int] = []
    errors: list[BaseException] = []
    first = threading.Event()

    def stream() -> None:
        try:
            with grpc.insecure_channel(stack.gateway_addr, options=channel_options()) as ch:
                for msg in gateway_pb2_grpc.GatewayStub(ch).Generate(long_req, timeout=180):
                    streamed.extend(msg.delta.token_ids)
                    first.set()
        except grpc.RpcError as exc:
            errors.append(exc)
            first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    results = []
    for _ in range(2):
        try:
            results.append(_generate(stack.gateway_addr, short))
        except grpc.RpcError as exc:
            errors.append(exc)
    t.join(180)
    assert stack.gateway.popen.poll() is None, (stack.gateway.popen.returncode, stack.gateway.lines[-5:])
    assert stack.shrinker.shrinks_refused + stack.shrinker.shrunk >= attacks + 2  # the attack was made, twice
    assert not errors and streamed == long_base, (errors, len(streamed), len(long_base))
    for ids, final in results:
        assert ids == short_base and final.stats.draft_fallback
    assert stack.shrinker.shrunk == 0  # the kernel refused every truncation (a sealed segment)


def _prefill(stack, sid: str, prompt, layers, share: bool = True):
    return stack.target_stub.Prefill(
        target_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt, hidden_layers=layers, want_hidden_share=share),
        timeout=60,
    )


def _eagle3_layers(stack) -> list[int]:
    return list(stack.draft_stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=10).hidden_layers)


def test_a_refused_prefill_leaves_no_segment_mapped(stack):
    """Each refusal the engine makes of a Prefill that asked for a hidden share (a repeated layer, 100 of them: the
    caller picked 200 MB before; a layer out of range; an id outside the vocabulary): INVALID_ARGUMENT, and the
    target process maps no segment after it, and /dev/shm holds no new name (before: the buffer stayed mapped until
    the target was killed). An accepted one maps its buffer until it is released (what the check can see)."""
    pid = stack.target.popen.pid
    layers = _eagle3_layers(stack)
    good = _prefill(stack, "mapped", PROMPT, layers)
    assert good.HasField("hidden_share")
    assert len(mapped_segments(pid)) == 1  # the check sees a live buffer
    stack.target_stub.Release(target_pb2.ReleaseRequest(session_id="mapped"), timeout=10)
    wait_until(lambda: not mapped_segments(pid), 5, lambda: mapped_segments(pid))
    vocab = stack.target_stub.GetInfo(target_pb2.TargetInfoRequest(), timeout=10).vocab_size
    refusals = {
        "repeated": (PROMPT, [layers[0]] * 100, "repeat a layer"),
        "out of range": (PROMPT, [layers[0], 10**6], "outside"),
        "out of vocabulary": ([*PROMPT, vocab + 5], layers, "outside the vocabulary"),
    }
    for kind, (prompt, hidden_layers, says) in refusals.items():
        with pytest.raises(grpc.RpcError) as exc:
            _prefill(stack, f"refused-{kind}", prompt, hidden_layers)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in exc.value.details(), (kind, exc.value)
        time.sleep(0.2)
        assert mapped_segments(pid) == [], (kind, mapped_segments(pid))
        assert not stack.new_names(), (kind, stack.new_names())
    stats = stack.target_stub.GetStats(target_pb2.TargetStatsRequest(), timeout=10)
    assert stats.active_sessions == 0 and stats.hidden_buffers == 0


def _hostile_named(nbytes: int) -> tuple[str, int]:
    """A segment by name in /dev/shm, as the target's buffers were before #44 (its maker can truncate it)."""
    name = "specserve-" + secrets.token_hex(12)
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, nbytes)
    return name, fd


def _hostile_offer(nbytes: int, key: bytes) -> tuple[str, int]:
    """An unsealed memfd offered at a socket of /dev/shm as the target offers its buffers (to any key)."""
    from specserve.runtime.shm_memfd import listen_at, send_fds

    name = "specserve-" + secrets.token_hex(12)
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    listener = listen_at(name)
    listener.setblocking(True)
    listener.settimeout(30)

    def serve() -> None:
        with listener:
            try:
                conn, _ = listener.accept()
            except (TimeoutError, socket.timeout):
                return
            with conn:
                conn.recv(64)
                send_fds(conn, [fd], b"H")
                conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    return name, fd


@pytest.mark.parametrize("how", ["named", "offered unsealed"])
def test_a_draft_survives_a_hidden_segment_shrunk_under_it(stack, how):
    """A local process hands the EAGLE-3 draft a segment of its own with a valid header and key, and truncates it
    once the draft could have mapped it; then asks for rows from it. The draft refuses to map it (it is not a sealed
    segment the target offered) or reads nothing past its end: it stays up and drafts for an honest request (before:
    it mapped the named segment and died of SIGBUS at the next read)."""
    from specserve.runtime.hidden_share import _HEADER, _MAGIC, DTYPES

    layers = _eagle3_layers(stack)
    real = _prefill(stack, "shape", PROMPT, layers)
    stack.target_stub.Release(target_pb2.ReleaseRequest(session_id="shape"), timeout=10)
    rows, cols = real.hidden_share.shape
    nbytes = _HEADER + rows * cols * DTYPES[real.hidden_share.dtype].itemsize
    key = secrets.token_bytes(32)
    name, fd = (_hostile_named if how == "named" else lambda n: _hostile_offer(n, key))(nbytes)
    try:
        os.pwrite(fd, _MAGIC + key, 0)
        share = HiddenShare()
        share.CopyFrom(real.hidden_share)
        share.handle = f"{name}:{key.hex()}".encode()
        start = draft_pb2.StartSessionRequest(session_id="intruder", token_ids=[*PROMPT, real.next_token])
        start.hidden_share.CopyFrom(share)
        start.hidden_rows.start, start.hidden_rows.stop = 0, len(PROMPT)
        started = True
        try:
            stack.draft_stub.StartSession(start, timeout=30)
        except grpc.RpcError as exc:
            started = False
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        os.ftruncate(fd, 0)  # under the draft's mapping, if it made one
        if started:
            step = draft_pb2.ProposeRequest(
                session_id="intruder", prefix_len=len(PROMPT) + 1, num_tokens=2, append_ids=[5]
            )
            step.append_rows.start, step.append_rows.stop = len(PROMPT), len(PROMPT) + 1
            with pytest.raises(grpc.RpcError):
                stack.draft_stub.Propose(step, timeout=30)
            time.sleep(0.5)
        assert stack.eagle3.popen.poll() is None, (stack.eagle3.popen.returncode, stack.eagle3.lines[-5:])
        assert not started, "the draft mapped a segment whose size its maker controls"
    finally:
        os.close(fd)
        (SHM_DIR / name).unlink(missing_ok=True)
    ids, final = _generate(
        stack.gateway_addr,
        gateway_pb2.GenerateRequest(prompt_ids=PROMPT, max_new_tokens=12, draft="eagle3", num_speculative_tokens=3),
    )
    assert len(ids) == 12 and not final.stats.draft_fallback
    stack.draft_stub.Release(draft_pb2.DraftReleaseRequest(session_id="intruder"), timeout=10)
