"""Target, draft and gateway as real processes over real gRPC (unix sockets + loopback TCP).

One stack for the module: `specserve target`, `specserve draft --draft ngram`, `specserve gateway`, all
exporting traces to an in-test OTLP receiver. Tests that break the stack (killing the draft, then the
target) run last, in file order.
"""

from __future__ import annotations

import asyncio
import signal
import struct
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import BackgroundServer, Proc, base_env, wait_until

from specserve.protos.specserve.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.servers_common import channel_options
from specserve.runtime.tracing import (
    ATTR_ACCEPTED,
    ATTR_BATCH_SIZE,
    ATTR_FORWARD_MS,
    ATTR_INPUT_TOKENS,
    ATTR_K,
    ATTR_MODEL,
    ATTR_OUTPUT_TOKENS,
    ATTR_TTFT_S,
    SPAN_DRAFT_PROPOSE,
    SPAN_DRAFT_START,
    SPAN_PREFILL,
    SPAN_REQUEST,
    SPAN_TARGET_RUN,
    SPAN_TARGET_VERIFY,
)

PROMPT = [5, 17, 99, 5, 17, 3, 42, 7, 5, 17]
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


ADMIN_TOKEN = "operator-secret"
ADMIN = (("specserve-admin-token", ADMIN_TOKEN),)


class Stack:
    def __init__(self, ckpt, sockets, otlp) -> None:
        self.ckpt = ckpt
        self.target_addr = f"unix:{sockets}/t.sock"
        self.draft_addr = f"unix:{sockets}/d.sock"
        self.env = base_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_METRIC_EXPORT_INTERVAL="500",
        )
        self.target = self.start_target()
        self.draft = self.start_draft()
        self.gateway = Proc(
            "gateway",
            [
                "--target",
                self.target_addr,
                "--draft-service",
                f"ngram={self.draft_addr}",
                "--model",
                str(ckpt),
                "--port",
                "0",
                "--draft-step-timeout-s",
                "2",
                "--admin-token",
                ADMIN_TOKEN,
            ],
            dict(self.env, OTEL_SERVICE_NAME="specserve-gateway"),
        )
        line = self.gateway.wait_line("gateway listening on ", timeout=180)
        self.gateway_addr = line.split()[-1]
        self.draft.wait_line("draft (ngram) listening on ", timeout=180)
        self.channel = grpc.insecure_channel(self.gateway_addr, options=channel_options())
        self.gw = gateway_pb2_grpc.GatewayStub(self.channel)
        self.tgt_channel = grpc.insecure_channel(self.target_addr, options=channel_options())
        self.tgt = target_pb2_grpc.TargetServiceStub(self.tgt_channel)

    def start_target(self) -> Proc:
        return Proc(
            "target",
            ["--model", str(self.ckpt), "--listen", self.target_addr, "--num-kv-blocks", "256"],
            dict(self.env, OTEL_SERVICE_NAME="specserve-target"),
        )

    def start_draft(self) -> Proc:
        return Proc(
            "draft",
            ["--draft", "ngram", "--model", str(self.ckpt), "--listen", self.draft_addr],
            dict(self.env, OTEL_SERVICE_NAME="specserve-draft"),
        )

    def draft_stats(self) -> draft_pb2.DraftStats:
        with grpc.insecure_channel(self.draft_addr) as ch:
            return draft_pb2_grpc.DraftServiceStub(ch).GetStats(draft_pb2.DraftStatsRequest(), timeout=5)

    def target_stats(self) -> target_pb2.TargetStats:
        return self.tgt.GetStats(target_pb2.TargetStatsRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        self.tgt_channel.close()
        for p in (self.gateway, self.draft, self.target):
            p.stop()


@pytest.fixture(scope="module")
def stack(tiny_target_dir, tmp_path_factory, otlp_receiver):
    s = Stack(tiny_target_dir, tmp_path_factory.mktemp("socks"), otlp_receiver)
    yield s
    s.close()


def request(draft: str = "", n: int = 24, prompt=PROMPT, **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt_ids=prompt,
        max_new_tokens=n,
        draft=draft,
        sampling=common_pb2.SamplingParams(**sampling),
        num_speculative_tokens=4,
    )


def generate(stack: Stack, req, timeout=None) -> tuple[list[int], gateway_pb2.FinalMessage]:
    ids, final = [], None
    for msg in stack.gw.Generate(req, timeout=timeout):
        if msg.HasField("final"):
            final = msg.final
        else:
            ids.extend(msg.delta.token_ids)
    assert final is not None
    return ids, final


# --------------------------------------------------------------------------------------- tests
def test_draft_and_target_only_agree_greedy(stack):
    base, fin0 = generate(stack, request(draft="none"))
    spec, fin1 = generate(stack, request(draft="ngram"))
    unary = stack.gw.GenerateUnary(request(draft="ngram"))  # also: no deadline at all, completes
    assert spec == base and list(unary.token_ids) == base and len(base) == 24
    assert fin0.finish_reason == fin1.finish_reason == "length"
    assert fin1.usage.prompt_tokens == len(PROMPT) and fin1.usage.completion_tokens == 24
    assert not fin1.stats.draft_fallback and fin1.stats.steps >= 1
    assert fin1.stats.steps <= len(base) - 1
    assert fin1.has_text and unary.text == fin1.text  # byte tokenizer: text is there
    assert stack.gw.ListDrafts(gateway_pb2.ListDraftsRequest(), metadata=ADMIN).drafts == {"ngram": stack.draft_addr}
    assert stack.gw.ListDrafts(gateway_pb2.ListDraftsRequest()).drafts == {"ngram": ""}  # names only (issue #44)


def test_one_trace_across_three_services(stack, otlp_receiver):
    """The target runs the step loop (Run, issue #42): the gateway's request span, the target's ``target.run`` under
    it, the loop's per-step ``draft.propose`` / ``target.verify`` spans under that (one a step), each draft-side
    propose span the child of the loop's span of the same step; the gateway has no per-step span any more."""
    _, final = generate(stack, request(draft="ngram", n=12))

    def trace_complete():
        spans = otlp_receiver.snapshot()
        roots = [s for s in spans if s.name == SPAN_REQUEST and s.attributes.get(ATTR_OUTPUT_TOKENS) == 12]
        if not roots:
            return None
        tid = roots[-1].trace_id
        mine = [s for s in spans if s.trace_id == tid]
        count = lambda svc, name: sum(s.service == svc and s.name == name for s in mine)  # noqa: E731
        steps = count("specserve-target", SPAN_TARGET_VERIFY)
        proposals = count("specserve-target", SPAN_DRAFT_PROPOSE)
        if (
            count("specserve-target", SPAN_TARGET_RUN) == 1
            and steps == final.stats.steps
            and proposals
            and (count("specserve-draft", SPAN_DRAFT_PROPOSE) == proposals)
        ):
            return roots[-1], mine
        return None

    root, spans = wait_until(trace_complete, 15, "spans of all three services in one trace")
    assert root.service == "specserve-gateway"
    assert root.attributes[ATTR_MODEL] and root.attributes[ATTR_INPUT_TOKENS] == len(PROMPT)
    assert ATTR_TTFT_S in root.attributes
    by = lambda svc, name: [s for s in spans if s.service == svc and s.name == name]  # noqa: E731
    (run,) = by("specserve-target", SPAN_TARGET_RUN)
    assert run.parent_span_id == root.span_id
    assert by("specserve-target", SPAN_PREFILL) and by("specserve-draft", SPAN_DRAFT_START)
    assert not by("specserve-gateway", SPAN_TARGET_VERIFY) and not by("specserve-gateway", SPAN_DRAFT_PROPOSE)
    t_verify = by("specserve-target", SPAN_TARGET_VERIFY)
    t_propose = by("specserve-target", SPAN_DRAFT_PROPOSE)
    d_propose = by("specserve-draft", SPAN_DRAFT_PROPOSE)
    assert len(t_verify) == final.stats.steps and len(d_propose) == len(t_propose) >= 1
    for s in t_verify:  # the loop's step span, with the engine's side of the step
        assert s.parent_span_id == run.span_id
        assert {ATTR_K, ATTR_ACCEPTED, ATTR_FORWARD_MS, ATTR_BATCH_SIZE} <= s.attributes.keys()
    assert all(s.parent_span_id == run.span_id for s in t_propose)
    # each draft-side propose span is the child of the target loop's span of the same step
    assert {s.parent_span_id for s in d_propose} == {s.span_id for s in t_propose}
    assert all(s.kind == SERVER_KIND for s in d_propose)
    # the gateway's speculative-decoding metrics arrive over OTLP as well
    wanted = {
        "specserve.spec.accepted",
        "specserve.spec.drafted",
        "specserve.spec.step_latency",
        "specserve.spec.accepted_length",
        "specserve.request.tokens",
        "specserve.request.ttft",
    }
    wait_until(lambda: wanted <= otlp_receiver.metric_names, 10, f"metrics {wanted}")


def test_target_run_refuses_what_is_no_request_and_serves_on(stack):
    """The target's Run (what a gateway hands it): a request that is none (no session, no tokens to make, a draft
    address that is no address, an id outside the vocabulary) is refused with one line, nothing is left open, and
    the next request runs to its final."""
    run = lambda **kw: list(stack.tgt.Run(target_pb2.RunRequest(**kw), timeout=30))  # noqa: E731
    bad = [
        dict(prompt_ids=PROMPT, max_new_tokens=4),
        dict(session_id="run-1", prompt_ids=PROMPT, max_new_tokens=0),
        dict(session_id="run-2", prompt_ids=PROMPT, max_new_tokens=4, draft_address="nowhere", draft_step_timeout_s=1),
        dict(session_id="run-3", prompt_ids=[1, 99999], max_new_tokens=4),
    ]
    for kw in bad:
        with pytest.raises(grpc.RpcError) as info:
            run(**kw)
        assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE), kw
        assert "\n" not in info.value.details()
    events = run(session_id="run-4", prompt_ids=PROMPT, max_new_tokens=6)
    assert events[-1].HasField("final") and events[-1].final.completion_tokens == 6
    assert sum(len(e.tokens.token_ids) for e in events[:-1]) == 6 and events[0].tokens.step is False
    assert all(e.tokens.step for e in events[1:-1])  # each later event is one verify step's
    wait_until(lambda: stack.target_stats().active_sessions == 0, 5, "the sessions released")


@pytest.mark.parametrize(
    "req,field",
    [
        (gateway_pb2.GenerateRequest(max_new_tokens=4), "prompt"),
        (gateway_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=100000), "max_new_tokens"),
        (gateway_pb2.GenerateRequest(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
        (request(temperature=-0.5), "sampling.temperature"),
        (request(top_p=1.5), "sampling.top_p"),
        (request(top_p=-0.1), "sampling.top_p"),
        (request(draft="nosuchdraft"), "draft"),
        (gateway_pb2.GenerateRequest(prompt_ids=[1, 999], max_new_tokens=4), "prompt_ids"),
    ],
)
def test_invalid_requests_name_the_field(stack, req, field):
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":")
    with pytest.raises(grpc.RpcError) as info:
        stack.gw.GenerateUnary(req, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_services_healthy_after_bad_requests(stack):
    for addr in (stack.gateway_addr, stack.target_addr, stack.draft_addr):
        with grpc.insecure_channel(addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    ids, final = generate(stack, request(draft="ngram", n=6), timeout=60)
    assert len(ids) == 6 and final.finish_reason == "length"


def test_cancel_frees_both_sessions_within_a_second(stack):
    call = stack.gw.Generate(request(draft="ngram", n=400))
    next(call), next(call)
    assert stack.target_stats().active_sessions == 1 and stack.draft_stats().active_sessions == 1
    t0 = time.monotonic()
    call.cancel()
    wait_until(
        lambda: (
            stack.target_stats().active_sessions == 0
            and stack.target_stats().kv_blocks_used == 0
            and stack.draft_stats().active_sessions == 0
        ),
        1.0,
        "both services report the session freed",
    )
    assert time.monotonic() - t0 < 1.0


def test_deadline_is_enforced_and_frees_sessions(stack):
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(draft="ngram", n=400), timeout=0.3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(
        lambda: stack.target_stats().active_sessions == 0 and stack.draft_stats().active_sessions == 0,
        2.0,
        "sessions freed after the deadline",
    )


def test_step_batching_one_forward_for_concurrent_sessions(stack):
    """Two sessions' verify requests queued while the engine thread is busy run as one batch."""
    import concurrent.futures

    sids = ["b1", "b2"]
    for sid in sids:
        stack.tgt.Prefill(target_pb2.PrefillRequest(session_id=sid, prompt_ids=PROMPT), timeout=10)
    sizes = []
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for attempt in range(5):  # the busy prefill must reach the engine thread first
                busy = pool.submit(
                    stack.tgt.Prefill,
                    target_pb2.PrefillRequest(session_id=f"busy{attempt}", prompt_ids=list(range(1, 250)) * 2),
                    timeout=30,
                )
                time.sleep(0.002)
                futs = [pool.submit(stack.tgt.Verify, target_pb2.VerifyRequest(session_id=s), timeout=30) for s in sids]
                resps = [f.result() for f in futs]
                busy.result()
                stack.tgt.Release(target_pb2.ReleaseRequest(session_id=f"busy{attempt}"), timeout=5)
                assert all(r.timings.queue_ms > 0 and r.timings.total_ms > 0 for r in resps)
                sizes.append(max(r.batch_size for r in resps))
                if sizes[-1] == 2:
                    break
        assert 2 in sizes, sizes
    finally:
        for sid in sids:
            stack.tgt.Release(target_pb2.ReleaseRequest(session_id=sid), timeout=5)


class BrokenDraft(draft_pb2_grpc.DraftServiceServicer):
    """A misbehaving draft service (fault injection): proposals are malformed in turn, or late."""

    def __init__(self, vocab_hash: str = "", delay_s: float = 0.0) -> None:
        self.vocab_hash, self.delay_s, self.calls = vocab_hash, delay_s, 0

    async def GetInfo(self, request, context):
        return draft_pb2.DraftInfo(family="broken", vocab_size=256, vocab_hash=self.vocab_hash, max_block_size=4)

    async def StartSession(self, request, context):
        return draft_pb2.StartSessionResponse(session_id=request.session_id)

    def _garbage(self, k: int) -> common_pb2.DraftBlock:
        self.calls += 1
        mode = self.calls % 5
        if mode == 0:  # ids outside the vocabulary
            return common_pb2.DraftBlock(token_ids=[300 + i for i in range(k)])
        if mode == 1:  # more tokens than asked for
            return common_pb2.DraftBlock(token_ids=[1] * (k + 3))
        if mode == 2:  # NaN probabilities
            nan = struct.pack("<f", float("nan")) * (k * 256)
            return common_pb2.DraftBlock(
                token_ids=[1] * k, has_probs=True, probs=common_pb2.Tensor(shape=[k, 256], data=nan)
            )
        if mode == 3:  # probs bytes that do not match their shape
            return common_pb2.DraftBlock(
                token_ids=[1] * k, has_probs=True, probs=common_pb2.Tensor(shape=[k, 256], data=b"xx")
            )
        return common_pb2.DraftBlock(token_ids=[1, 2], parents=[-1, 7], is_tree=True)  # bad tree

    async def ProposeStream(self, request_iterator, context):
        async for req in request_iterator:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield draft_pb2.ProposeResponse(session_id=req.session_id, draft=self._garbage(req.num_tokens))

    async def Release(self, request, context):
        return draft_pb2.DraftReleaseResponse(released=True)


@pytest.fixture(scope="module")
def broken_drafts(tmp_path_factory):
    socks = tmp_path_factory.mktemp("broken")
    server = BackgroundServer()
    addrs = {}
    for name, servicer in {
        "junk": BrokenDraft(),
        "slow": BrokenDraft(delay_s=2.5),
        "alien": BrokenDraft(vocab_hash="sha256:not-this-vocabulary"),
    }.items():
        addrs[name] = f"unix:{socks}/{name}.sock"
        server.serve(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer, addrs[name])
    yield addrs
    server.close()


def test_set_draft_needs_the_operator_credential(stack, broken_drafts):
    """SetDraft is refused (PERMISSION_DENIED) without the admin token or with a wrong one; a granted
    change is logged."""
    req = gateway_pb2.SetDraftRequest(name="junk", address=broken_drafts["junk"])
    for metadata in ((), (("specserve-admin-token", "guess"),), (("authorization", f"Bearer {ADMIN_TOKEN}"),)):
        with pytest.raises(grpc.RpcError) as info:
            stack.gw.SetDraft(req, timeout=10, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert set(stack.gw.ListDrafts(gateway_pb2.ListDraftsRequest()).drafts) == {"ngram"}
    stack.gw.SetDraft(req, timeout=10, metadata=ADMIN)
    stack.gw.SetDraft(gateway_pb2.SetDraftRequest(name="junk", address=""), timeout=10, metadata=ADMIN)

    def logged() -> int:
        return sum("gateway: SetDraft 'junk'" in line for line in list(stack.gateway.lines))

    deadline = time.monotonic() + 10  # the line reaches the test's reader thread after the reply (late under load)
    while logged() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert logged() == 2


def test_set_draft_and_broken_drafts_stay_lossless(stack, broken_drafts):
    base, _ = generate(stack, request(draft="none", n=16))
    for name in ("junk", "slow"):
        resp = stack.gw.SetDraft(
            gateway_pb2.SetDraftRequest(name=name, address=broken_drafts[name]), timeout=10, metadata=ADMIN
        )
        assert resp.address == broken_drafts[name]
    assert set(stack.gw.ListDrafts(gateway_pb2.ListDraftsRequest()).drafts) == {"ngram", "junk", "slow"}
    ids, final = generate(stack, request(draft="junk", n=16), timeout=60)
    assert ids == base and final.stats.steps == 15  # every garbage block dropped: one token per step
    t0 = time.monotonic()
    ids, final = generate(stack, request(draft="slow", n=16), timeout=60)
    assert ids == base and final.stats.draft_fallback and time.monotonic() - t0 < 10
    with pytest.raises(grpc.RpcError) as info:
        stack.gw.SetDraft(
            gateway_pb2.SetDraftRequest(name="alien", address=broken_drafts["alien"]), timeout=10, metadata=ADMIN
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "vocabulary" in info.value.details()
    alien = lambda: [line for line in list(stack.gateway.lines) if "gateway: SetDraft 'alien'" in line] or None  # noqa: E731
    (logged,) = wait_until(alien, 10, "the gateway's SetDraft 'alien' line")  # read after the reply (late under load)
    assert "failed: FAILED_PRECONDITION: address:" in logged, logged  # not logged like a swap that happened
    swapped = [line for line in stack.gateway.lines if "gateway: SetDraft 'junk' -> 'unix" in line]
    assert swapped and all(line.endswith(": in use") for line in swapped), swapped
    for name in ("junk", "slow"):
        stack.gw.SetDraft(gateway_pb2.SetDraftRequest(name=name, address=""), timeout=10, metadata=ADMIN)
    assert set(stack.gw.ListDrafts(gateway_pb2.ListDraftsRequest()).drafts) == {"ngram"}
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(draft="junk", n=4), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_draft_killed_mid_stream_then_back(stack):
    base, _ = generate(stack, request(draft="none", n=150))
    call = stack.gw.Generate(request(draft="ngram", n=150))
    ids = list(next(call).delta.token_ids)
    stack.draft.stop(signal.SIGKILL)
    final = None
    for msg in call:
        if msg.HasField("final"):
            final = msg.final
        else:
            ids.extend(msg.delta.token_ids)
    assert ids == base
    assert final.stats.draft_fallback
    # while the draft is down, requests complete target-only
    ids2, fin2 = generate(stack, request(draft="ngram", n=8), timeout=30)
    assert ids2 == base[:8] and fin2.stats.draft_fallback
    stack.draft = stack.start_draft()
    stack.draft.wait_line("draft (ngram) listening on ", timeout=120)

    def uses_draft():
        ids3, fin3 = generate(stack, request(draft="ngram", n=8), timeout=30)
        assert ids3 == base[:8]
        return not fin3.stats.draft_fallback

    wait_until(uses_draft, 10, "requests use the restarted draft again")


def test_target_down_gives_unavailable_within_deadline(stack):
    stack.target.stop(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(draft="ngram", n=8), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 5
