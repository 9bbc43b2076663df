"""Target hidden rows in a shared buffer the drafter maps (specserve/runtime/hidden_share.py), through real
processes: the shipped demo target, its EAGLE-3 and DFlash drafters as draft services, and two gateways
over them: one hands the hidden rows over as a buffer (the default: target and drafts report the same
host), one with SPECSERVE_HIDDEN_SHARE=0 sends them as bytes in the messages. The services' GetStats
count the rows each way.

- greedy: shared buffer, bytes and one process (the engine's own target-only greedy decode) give the
  same tokens, and the shared path sent no hidden row as bytes (the bytes gateway, as main's code, did);
- sampled: the shared path follows the target's law (two-sample chi-square, with its negative control);
- bad handles and row ranges get one clear line and the right status; cancel and deadline free the
  buffer at both ends;
- SIGKILL of a drafter mid-session: the requests go on target-only, losslessly; nothing stays in /dev/shm.
Tests that kill processes run last, in file order.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from served_stack import ServedStack, generate, req, run_concurrently, wait_no_names
from service_helpers import base_env, wait_until
from stats_helpers import two_sample_pvalue

from specserve.paths import demo_checkpoint
from specserve.protos.specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.shm_layout import SHM_DIR

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")

TEXTS = ["def parse_args(argv):\n", "import os\nimport sys\n\n\nclass ", "    for i in range(len(", "# Copyright"]
N_NEW = 32
DRAFTS = ("eagle3", "dflash")


class Stack(ServedStack):
    """One target, one draft service per family, and a gateway per way of sending hidden rows."""

    def __init__(self, socks, device: str = "cpu", extra: tuple[str, ...] = ()) -> None:
        from specserve.models.loader import load_tokenizer

        self.target_dir = demo_checkpoint("target")
        tok = load_tokenizer(self.target_dir)
        self.prompts = [tok.encode(t).ids for t in TEXTS]
        place = ["--device", device, *extra]
        abandon = ["--shm-abandon-s", "4"]  # a gateway killed before it attached: its sessions go after 4 s
        drafts = {
            d: [
                "--draft",
                d,
                "--draft-model",
                str(demo_checkpoint(d)),
                "--model",
                str(self.target_dir),
                *place[:2],
                *abandon,
            ]
            for d in DRAFTS
        }
        super().__init__(
            socks,
            ["--model", str(self.target_dir), *place, *abandon],
            drafts,
            {"share": base_env(), "bytes": base_env(SPECSERVE_HIDDEN_SHARE="0")},
            step_timeout_s=20,
            start_timeout_s=300,
        )

    def target_stub(self, ch):
        return target_pb2_grpc.TargetServiceStub(ch)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("hidden"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def one_process(stack):
    """Greedy target-only decode of each prompt in this process (no service, no transport)."""
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=stack.target_dir))
    return {i: engine.generate_greedy(p, N_NEW) for i, p in enumerate(stack.prompts)}


def counts(stack: Stack) -> dict[str, int]:
    t = stack.target_stats()
    out = {"target shared": t.hidden_rows_shared, "target bytes": t.hidden_rows_as_bytes}
    for d in DRAFTS:
        s = stack.draft_stats(d)
        out[f"{d} shared"], out[f"{d} bytes"] = s.hidden_rows_shared, s.hidden_rows_as_bytes
    return out


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def run_greedy(stack: Stack, one_process, via: str) -> dict:
    """Each request's tokens must be the one-process ones; returns what was accepted at each step."""
    accepted = {}
    for draft in DRAFTS:
        for i, prompt in enumerate(stack.prompts):
            ids, final, code, _ = generate(stack, via, req(prompt, N_NEW, draft))
            assert code is None and ids == one_process[i], (via, draft, i)
            assert not final.stats.draft_fallback, (via, draft, i)
            assert final.stats.mean_accepted_length > 1.2, (via, draft, i)  # the drafter really drafted
            accepted[draft, i] = (final.stats.steps, list(final.stats.accepted_per_position))
    for i, prompt in enumerate(stack.prompts[:2]):  # EAGLE-3 trees: a path's rows are written once it is known
        r = req(prompt, N_NEW, "eagle3")
        r.tree_nodes, r.tree_top_k, r.tree_depth = 6, 2, 3
        ids, final, code, _ = generate(stack, via, r)
        assert code is None and ids == one_process[i] and not final.stats.draft_fallback, (via, "tree", i)
        accepted["tree", i] = (final.stats.steps, list(final.stats.accepted_per_position))
    return accepted


def test_greedy_shared_buffer_equals_bytes_equals_one_process(stack, one_process):
    assert stack.target_stats().hidden_rows_shared == 0  # nothing asked yet
    c0 = counts(stack)
    via_buffer = run_greedy(stack, one_process, "share")
    c1 = counts(stack)
    via_bytes = run_greedy(stack, one_process, "bytes")
    c2 = counts(stack)
    assert via_buffer == via_bytes  # the drafters drafted the same blocks: they read the same rows
    shared, sent = delta(c1, c0), delta(c2, c1)
    # the shared path: every hidden row went as a row range, none as bytes, at either end
    assert shared["target bytes"] == 0 and shared["target shared"] > 0, shared
    for d in DRAFTS:
        assert shared[f"{d} bytes"] == 0 and shared[f"{d} shared"] > 0, shared
    assert shared["eagle3 shared"] + shared["dflash shared"] <= shared["target shared"], shared
    # the bytes path (what main's code does for every session) fails those same checks
    assert sent["target shared"] == 0 and sent["target bytes"] > 0, sent
    for d in DRAFTS:
        assert sent[f"{d} shared"] == 0 and sent[f"{d} bytes"] > 0, sent
    wait_no_names(stack)


SAMPLE_TEXT = "def "
N_SAMPLES, POS = 200, 3


def sample(stack: Stack, draft: str, temperature: float, seed0: int) -> tuple[Counter, int]:
    from specserve.models.loader import load_tokenizer

    prompt = load_tokenizer(stack.target_dir).encode(SAMPLE_TEXT).ids

    def one(i: int):
        r = req(prompt, POS + 1, draft)
        r.sampling.temperature, r.sampling.top_k, r.sampling.seed = temperature, 8, seed0 + i
        return stack.gw["share"].GenerateUnary(r, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(N_SAMPLES)))
    assert not any(r.final.stats.draft_fallback for r in results)
    return Counter(r.token_ids[POS] for r in results), sum(sum(r.final.stats.accepted_per_position) for r in results)


def test_sampled_shared_buffer_path_follows_the_target(stack):
    ref, _ = sample(stack, "none", 1.0, 10_000)
    control, _ = sample(stack, "none", 0.5, 20_000)
    assert two_sample_pvalue(control, ref) < 1e-3, (dict(control), dict(ref))  # the test can tell laws apart
    for draft in DRAFTS:
        c0 = counts(stack)
        spec, accepted = sample(stack, draft, 1.0, 0)
        moved = delta(counts(stack), c0)
        assert moved[f"{draft} shared"] > 0 and moved[f"{draft} bytes"] == 0, moved  # over the shared buffer
        assert accepted > N_SAMPLES // 10, (draft, accepted)  # drafted tokens were accepted: the draft took part
        assert two_sample_pvalue(spec, ref) > 1e-3, (draft, dict(spec), dict(ref))


def test_bad_handles_and_row_ranges_get_one_line_and_the_right_status(stack):
    """A handle that cannot be mapped: FAILED_PRECONDITION; rows outside the buffer, a range without a
    handle, a malformed handle: INVALID_ARGUMENT; one line each, and nothing is left in /dev/shm."""
    prompt = stack.prompts[0]
    with grpc.insecure_channel(stack.target_addr) as tch, grpc.insecure_channel(stack.drafts["eagle3"]) as dch:
        target, draft = stack.target_stub(tch), draft_pb2_grpc.DraftServiceStub(dch)
        layers = list(draft.GetInfo(draft_pb2.DraftInfoRequest(), timeout=5).hidden_layers)
        pre = target.Prefill(
            target_pb2.PrefillRequest(
                session_id="bad-share", prompt_ids=prompt, hidden_layers=layers, want_hidden_share=True
            ),
            timeout=30,
        )
        assert pre.HasField("hidden_share") and not pre.HasField("hidden") and pre.hidden_share.kind == "host_shm"
        assert (pre.hidden_rows.start, pre.hidden_rows.stop) == (0, len(prompt))
        rows = common_pb2.HiddenRows(start=0, stop=len(prompt))

        def start(sid, share, hidden_rows=rows):
            r = draft_pb2.StartSessionRequest(session_id=sid, token_ids=[*prompt, pre.next_token])
            if share is not None:
                r.hidden_share.CopyFrom(share)
            if hidden_rows is not None:
                r.hidden_rows.CopyFrom(hidden_rows)
            return draft.StartSession(r, timeout=30)

        def refused(call, code) -> str:
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == code, exc.value
            details = exc.value.details()
            assert "\n" not in details and "Traceback" not in details
            return details

        gone = common_pb2.HiddenShare(
            kind="host_shm",
            shape=list(pre.hidden_share.shape),
            dtype=pre.hidden_share.dtype,
            handle=b"specserve-000000000000000000000000:" + b"00" * 32,
        )
        assert "cannot open segment" in refused(lambda: start("s1", gone), grpc.StatusCode.FAILED_PRECONDITION)
        cuda = common_pb2.HiddenShare(kind="cuda_ipc", shape=[8, 8], dtype="float32", handle=b"{}")
        refused(lambda: start("s2", cuda), grpc.StatusCode.FAILED_PRECONDITION)  # a CPU draft maps host_shm only
        odd = common_pb2.HiddenShare(kind="host_shm", shape=[8], dtype="float32", handle=b"x")
        assert "hidden_share.shape" in refused(lambda: start("s3", odd), grpc.StatusCode.INVALID_ARGUMENT)
        assert "without hidden_share" in refused(lambda: start("s4", None), grpc.StatusCode.INVALID_ARGUMENT)
        wider = common_pb2.HiddenShare()
        wider.CopyFrom(pre.hidden_share)
        wider.shape[0] = 10**6  # more rows than the segment holds
        assert "needs" in refused(lambda: start("s5", wider), grpc.StatusCode.FAILED_PRECONDITION)
        # the real handle maps; then rows past the buffer are refused
        start("good", pre.hidden_share)
        past = draft_pb2.ProposeRequest(session_id="good", prefix_len=len(prompt) + 1, num_tokens=2)
        past.append_rows.start, past.append_rows.stop = 10**6, 10**6 + 1
        assert "outside the shared buffer" in refused(
            lambda: draft.Propose(past, timeout=30), grpc.StatusCode.INVALID_ARGUMENT
        )
        block = draft.Propose(
            draft_pb2.ProposeRequest(session_id="good", prefix_len=len(prompt) + 1, num_tokens=2), timeout=30
        )
        assert len(block.draft.token_ids) == 2  # the session is still fine
        for sid in ("s1", "s2", "s3", "s4", "s5", "good"):
            draft.Release(draft_pb2.DraftReleaseRequest(session_id=sid), timeout=10)
        target.Release(target_pb2.ReleaseRequest(session_id="bad-share"), timeout=10)
    wait_no_names(stack)


def test_a_caller_who_lists_dev_shm_cannot_map_or_unlink_a_sessions_buffer(stack):
    """#33, the confused deputy: /dev/shm is world-listable. A caller who lists it while a victim's
    session is between its Prefill and its draft's StartSession hands the draft every new name as a
    hidden buffer (the buffer's and the verify ring's; bare, as before #33 a handle was, or with a made-up
    key): each is refused, the draft maps nothing and unlinks nothing, and the victim's own StartSession
    (with the handle its Prefill carried) maps its buffer and drafts from it, and its ring still attaches."""
    from specserve.runtime.data_plane import ShmClient

    prompt = stack.prompts[1]
    before = set(stack.new_names())
    with grpc.insecure_channel(stack.target_addr) as tch, grpc.insecure_channel(stack.drafts["dflash"]) as dch:
        target, draft = stack.target_stub(tch), draft_pb2_grpc.DraftServiceStub(dch)
        layers = list(draft.GetInfo(draft_pb2.DraftInfoRequest(), timeout=5).hidden_layers)
        pre = target.Prefill(
            target_pb2.PrefillRequest(
                session_id="victim", prompt_ids=prompt, hidden_layers=layers, want_hidden_share=True, want_shm=True
            ),
            timeout=30,
        )
        assert pre.HasField("hidden_share") and pre.shm_channel
        # what `ls /dev/shm` shows of this session (the target offers both; another suite's names are not its)
        listed = sorted((stack.new_names() - before) & stack.target_offers())
        assert len(listed) == 2, listed  # the victim's buffer and its verify ring
        rows = common_pb2.HiddenRows(start=0, stop=len(prompt))

        def start(sid, handle: bytes):
            r = draft_pb2.StartSessionRequest(session_id=sid, token_ids=[*prompt, pre.next_token])
            r.hidden_share.CopyFrom(pre.hidden_share)
            r.hidden_share.handle = handle
            r.hidden_rows.CopyFrom(rows)
            return draft.StartSession(r, timeout=30)

        for i, name in enumerate(listed):
            for j, handle in enumerate((name.encode(), f"{name}:{'ab' * 32}".encode())):
                with pytest.raises(grpc.RpcError) as exc:
                    start(f"intruder-{i}-{j}", handle)
                assert exc.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)
                assert "\n" not in exc.value.details()
        assert stack.draft_stats("dflash").hidden_buffers == 0  # the intruder mapped nothing
        assert set(listed) <= set(stack.new_names())  # and unlinked nothing
        r = draft_pb2.StartSessionRequest(session_id="victim", token_ids=[*prompt, pre.next_token])
        r.hidden_share.CopyFrom(pre.hidden_share)
        r.hidden_rows.CopyFrom(rows)
        draft.StartSession(r, timeout=30)  # the victim's own handle maps
        block = draft.Propose(
            draft_pb2.ProposeRequest(session_id="victim", prefix_len=len(prompt) + 1, num_tokens=2), timeout=30
        )
        assert len(block.draft.token_ids) == 2 and stack.draft_stats("dflash").hidden_rows_shared > 0
        ring = asyncio.run(ShmClient.attach(pre.shm_channel))
        assert ring is not None  # the verify ring was not taken either
        ring.close()
        draft.Release(draft_pb2.DraftReleaseRequest(session_id="victim"), timeout=10)
        target.Release(target_pb2.ReleaseRequest(session_id="victim"), timeout=10)
    wait_no_names(stack)


def test_a_draft_that_cannot_map_costs_one_request_its_speculation_then_gets_bytes(stack):
    """The gateway's draft adapter: a StartSession whose buffer the draft cannot map is a DraftError (that
    request goes on target-only) and the endpoint stops asking for buffers; it asked while both sides
    reported one host."""
    import asyncio

    from specserve.contract.types import SamplingParams, SharedRows
    from specserve.loop.clients import DraftError
    from specserve.loop.remote_draft import RemoteDraftEndpoint

    async def run() -> None:
        with grpc.insecure_channel(stack.target_addr) as ch:
            target_info = stack.target_stub(ch).GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
        ep = RemoteDraftEndpoint("eagle3", stack.drafts["eagle3"], step_timeout_s=20.0, target_info=target_info)
        try:
            await ep.fetch_info(10.0)
            assert ep.maps_hidden_of(target_info)  # same host, a kind it maps
            gone = common_pb2.HiddenShare(
                kind="host_shm",
                shape=[64, 768],
                dtype="float32",
                handle=b"specserve-111111111111111111111111:" + b"11" * 32,
            )
            session = ep.session(None)
            with pytest.raises(DraftError, match="FAILED_PRECONDITION"):
                await session.start("unmappable", [1, 2, 3], SharedRows(0, 2, handle=gone), SamplingParams())
            assert not ep.maps_hidden_of(target_info)  # bytes from now on
            await session.release("unmappable")
        finally:
            await ep.close()

    asyncio.run(run())


def buffers(stack: Stack, draft: str) -> tuple[int, int]:
    """(buffers the target holds, buffers the draft maps) now."""
    return stack.target_stats().hidden_buffers, stack.draft_stats(draft).hidden_buffers


def test_cancel_and_deadline_free_the_buffer_on_both_sides(stack):
    assert buffers(stack, "dflash") == (0, 0)
    call = stack.gw["share"].Generate(req(stack.prompts[1], 400, "dflash"), timeout=60)
    next(call), next(call)
    assert buffers(stack, "dflash") == (1, 1)  # the target holds it, the draft maps it
    call.cancel()
    wait_until(lambda: buffers(stack, "dflash") == (0, 0), 2.0, "both freed the cancelled session's buffer")
    _, _, code, _ = generate(stack, "share", req(stack.prompts[2], 400, "dflash"), timeout=0.5)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: buffers(stack, "dflash") == (0, 0), 2.0, "both freed the buffer after the deadline")
    wait_no_names(stack)


# ------------------------------------------------------------------------------------------ faults
def _restart_gateway(stack: Stack, via: str) -> None:
    from service_helpers import Proc

    from specserve.protos.specserve.v1 import gateway_pb2_grpc
    from specserve.runtime.servers_common import channel_options

    old = stack.gateways[via]
    old.stop(signal.SIGKILL)
    stack.channels[via].close()
    stack.gateways[via] = Proc("gateway", old.argv, old.env)
    stack.addr[via] = stack.gateways[via].wait_line("gateway listening on ", timeout=120).split()[-1]
    stack.channels[via] = grpc.insecure_channel(stack.addr[via], options=channel_options())
    stack.gw[via] = gateway_pb2_grpc.GatewayStub(stack.channels[via])


def test_gateway_killed_with_sessions_in_flight_leaves_no_buffer(stack):
    """#33 (the target once reported hidden_buffers=2 with 0 sessions after a campaign): the gateway is
    SIGKILLed three times with six requests in flight (some in their Prefill, some between a Prefill's
    reply and the channel's attach, some drafting from their buffers) and restarted each time: within
    the services' --shm-abandon-s (4 s here) the target holds no session and no buffer, the drafts map
    none, nothing stays in /dev/shm, and the restarted gateway shares buffers again. Before, a session
    whose gateway died before attaching waited for the idle expiry (300 s) with its buffer."""

    def state():
        return (
            stack.target_stats().active_sessions,
            stack.target_stats().hidden_buffers,
            [stack.draft_stats(d).hidden_buffers for d in DRAFTS],
        )

    for round_ in range(3):
        calls = [
            stack.gw["share"].Generate(req(stack.prompts[i % len(stack.prompts)], 300, DRAFTS[i % 2]), timeout=60)
            for i in range(6)
        ]
        if round_:  # the first round kills at once: Prefills in flight
            deadline = time.monotonic() + 30
            while stack.target_stats().hidden_buffers < 2 * round_ and time.monotonic() < deadline:
                time.sleep(0.005)
        _restart_gateway(stack, "share")
        for c in calls:
            c.cancel()
        deadline = time.monotonic() + 10
        while state() != (0, 0, [0, 0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state() == (0, 0, [0, 0]), (round_, state())
        wait_no_names(stack)
    ids, final, code, _ = generate(stack, "share", req(stack.prompts[0], 8, "dflash"))
    assert code is None and len(ids) == 8 and not final.stats.draft_fallback
    assert stack.target_stats().hidden_rows_shared > 0


def test_drafter_killed_mid_session_goes_on_target_only_losslessly(stack, one_process):
    n = 3 * N_NEW
    want = {}
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=stack.target_dir))
    for i, p in enumerate(stack.prompts):
        want[i] = engine.generate_greedy(p, n)
    specs = [i % len(stack.prompts) for i in range(6)]
    shared0 = stack.draft_stats("eagle3").hidden_rows_shared

    def kill_draft():
        deadline = time.monotonic() + 60
        while stack.draft_stats("eagle3").hidden_rows_shared < shared0 + 200 and time.monotonic() < deadline:
            time.sleep(0.01)  # the requests are drafting from the shared buffers now
        stack.draft_procs["eagle3"].stop(signal.SIGKILL)
        time.sleep(0.2)
        seen.append((stack.target_stats().active_sessions, stack.new_names()))  # while the requests go on

    seen = []
    results = run_concurrently(
        stack, "share", [req(stack.prompts[p], n, "eagle3", k=2) for p in specs], 120.0, kill_draft
    )
    assert seen[0][0] > 0 and not seen[0][1], seen  # no name of a running session's buffer in /dev/shm
    assert [r[2] for r in results] == [None] * len(specs)
    for p, (ids, final, _, _) in zip(specs, results):
        assert ids == want[p]
    assert any(r[1].stats.draft_fallback for r in results)
    assert stack.target_stats().active_sessions == 0 and stack.target_stats().hidden_buffers == 0
    wait_no_names(stack)


# -------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_target_hands_its_device_rows_over_as_cuda_ipc_and_gives_the_tokens_of_bytes(tmp_path):
    """The same stack on cuda (bfloat16, CUDA graphs with the heads' layers): the target's buffer is a CUDA
    tensor handed over as a CUDA IPC handle, the drafters read the rows from the target's device memory;
    tokens and per-step acceptance equal the bytes path's (greedy), and no hidden row went as bytes."""
    gpu = Stack(tmp_path, device="cuda", extra=("--dtype", "bfloat16", "--graph-hidden-layers", "1,2,4"))
    try:
        with grpc.insecure_channel(gpu.target_addr) as ch:
            info = gpu.target_stub(ch).GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
        assert info.hidden_share_kind == "cuda_ipc"
        for d in DRAFTS:
            with grpc.insecure_channel(gpu.drafts[d]) as ch:
                assert (
                    "cuda_ipc"
                    in draft_pb2_grpc.DraftServiceStub(ch)
                    .GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)
                    .hidden_share_kinds
                )
        results = {}
        for via in ("bytes", "share"):
            before = counts(gpu)
            for draft in DRAFTS:
                for i, prompt in enumerate(gpu.prompts):
                    ids, final, code, _ = generate(gpu, via, req(prompt, N_NEW, draft))
                    assert code is None and not final.stats.draft_fallback, (via, draft, i, code)
                    results[via, draft, i] = (ids, final.stats.steps, list(final.stats.accepted_per_position))
            moved = delta(counts(gpu), before)
            if via == "share":
                assert moved["target bytes"] == 0 and moved["target shared"] > 0, moved
                assert all(moved[f"{d} bytes"] == 0 and moved[f"{d} shared"] > 0 for d in DRAFTS), moved
        for draft in DRAFTS:
            for i in range(len(gpu.prompts)):
                assert results["share", draft, i] == results["bytes", draft, i], (draft, i)
        wait_no_names(gpu)
    finally:
        gpu.close()
