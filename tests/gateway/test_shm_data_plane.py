"""The shared-memory data plane through real processes: a target, a `model` draft (the tiny target's own
checkpoint: it reports q), an ngram draft, and two gateways over them: one asks for shared memory
(the default), one runs with SPECSERVE_SHM=0 ("a peer on another host": every step over gRPC). The
services' GetStats say which path the steps took.

- greedy: the shm path, the gRPC path and one process (the engine's own target-only greedy decode)
  give the same tokens;
- sampled: the shm path follows the target's law (two-sample chi-square, with its negative control);
- SIGKILL of a drafter mid-step: the requests go on target-only, losslessly; of the target: UNAVAILABLE
  within the deadline; either way nothing is left in /dev/shm.
Tests that kill processes run last, in file order.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from served_stack import ServedStack, generate, req, run_concurrently, wait_no_names
from service_helpers import base_env, wait_until
from stats_helpers import two_sample_pvalue

from specserve.protos.specserve.v1 import (
    target_pb2,
    target_pb2_grpc,
)
from specserve.runtime.shm_layout import SHM_DIR, leftover_names

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")

PROMPTS = [[(5 * i + 11 * j) % 256 for j in range(5 + 2 * i)] for i in range(4)]
N_NEW = 24
N_LONG = 400  # long enough that every request is still running when its target is killed


class Stack(ServedStack):
    def __init__(self, ckpt, socks) -> None:
        self.ckpt = ckpt
        drafts = {
            "model": ["--draft", "model", "--draft-model", str(ckpt), "--model", str(ckpt)],
            "ngram": ["--draft", "ngram", "--model", str(ckpt)],
        }
        super().__init__(
            socks,
            ["--model", str(ckpt)],
            drafts,
            {
                # the gateway drives the steps (a request with stop strings; a target without Run): its own channels
                "shm": base_env(SPECSERVE_TARGET_LOOP="0"),
                "grpc": base_env(SPECSERVE_SHM="0", SPECSERVE_TARGET_LOOP="0"),
                # the target runs the loop (Run, issue #42): its proposals over the draft's ring, no gateway channel
                "loop": base_env(),
            },
            step_timeout_s=10,
            start_timeout_s=180,
        )


@pytest.fixture(scope="module")
def stack(tiny_target_dir, tmp_path_factory):
    s = Stack(tiny_target_dir, tmp_path_factory.mktemp("shm"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def one_process(tiny_target_dir):
    """Greedy target-only decode of each prompt in this process (no service, no transport)."""
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=tiny_target_dir, num_kv_blocks=256, kv_block_size=4))
    return {i: engine.generate_greedy(p, N_LONG) for i, p in enumerate(PROMPTS)}


def test_greedy_shm_equals_grpc_equals_one_process(stack, one_process):
    t0, m0, n0 = stack.target_stats(), stack.draft_stats("model"), stack.draft_stats("ngram")
    for draft in ("model", "ngram", "none"):
        for i, prompt in enumerate(PROMPTS):
            ids, final, code, _ = generate(stack, "shm", req(prompt, N_NEW, draft))
            assert code is None and ids == one_process[i][:N_NEW], (draft, i)
            assert not final.stats.draft_fallback
    t1, m1, n1 = stack.target_stats(), stack.draft_stats("model"), stack.draft_stats("ngram")
    # every verify step of those requests went through shared memory, and every proposal
    assert t1.shm_steps - t0.shm_steps == t1.steps - t0.steps > 0
    assert t1.shm_channels - t0.shm_channels == 3 * len(PROMPTS)
    assert m1.shm_proposals - m0.shm_proposals == m1.proposals - m0.proposals > 0
    assert n1.shm_proposals - n0.shm_proposals == n1.proposals - n0.proposals > 0
    assert not stack.new_names()


def test_target_loop_drafts_over_shm_and_the_gateway_opens_no_channel(stack, one_process):
    """The target runs the step loop (Run): the same tokens; every proposal over the draft's ring, from the target;
    no step between gateway and target at all (no channel, no VerifyStream: the loop calls the engine's host)."""
    t0, m0, n0 = stack.target_stats(), stack.draft_stats("model"), stack.draft_stats("ngram")
    for draft in ("model", "ngram", "none"):
        for i, prompt in enumerate(PROMPTS):
            ids, final, code, _ = generate(stack, "loop", req(prompt, N_NEW, draft))
            assert code is None and ids == one_process[i][:N_NEW], (draft, i)
            assert not final.stats.draft_fallback and final.stats.steps > 0
    t1, m1, n1 = stack.target_stats(), stack.draft_stats("model"), stack.draft_stats("ngram")
    assert t1.steps > t0.steps and (t1.shm_steps, t1.shm_channels) == (t0.shm_steps, t0.shm_channels)
    assert m1.shm_proposals - m0.shm_proposals == m1.proposals - m0.proposals > 0
    assert n1.shm_proposals - n0.shm_proposals == n1.proposals - n0.proposals > 0
    assert not stack.new_names()


def test_disabled_fast_path_uses_grpc_and_gives_the_same_tokens(stack, one_process):
    t0, m0 = stack.target_stats(), stack.draft_stats("model")
    for draft in ("model", "none"):
        for i, prompt in enumerate(PROMPTS):
            ids, final, code, _ = generate(stack, "grpc", req(prompt, N_NEW, draft))
            assert code is None and ids == one_process[i][:N_NEW], (draft, i)
    t1, m1 = stack.target_stats(), stack.draft_stats("model")
    assert t1.steps > t0.steps and m1.proposals > m0.proposals
    assert (t1.shm_steps, t1.shm_channels, m1.shm_proposals) == (t0.shm_steps, t0.shm_channels, m0.shm_proposals)


def test_an_offer_nobody_attaches_to_leaves_the_session_on_grpc_and_nothing_behind(stack, one_process):
    """A caller that cannot open the offered channel (another host) verifies over VerifyStream as
    before; its first step over gRPC removes the offered names."""
    with grpc.insecure_channel(stack.target_addr) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        pre = stub.Prefill(
            target_pb2.PrefillRequest(session_id="far-away", prompt_ids=PROMPTS[0], want_shm=True), timeout=10
        )
        assert pre.shm_channel.partition(":")[0] in leftover_names()  # offered, not attached (a ticket: name:key)
        got = [pre.next_token]
        steps = stub.VerifyStream(iter([target_pb2.VerifyRequest(session_id="far-away")] * 5), timeout=10)
        for resp in steps:
            got.append(resp.next_token)
        assert got == one_process[0][:6]
        wait_no_names(stack, timeout=2.0)  # steps over gRPC withdrew the offer (not the 5 s attach timeout)
        stub.Release(target_pb2.ReleaseRequest(session_id="far-away"), timeout=10)


def test_cancel_and_deadline_reach_both_services_over_shm(stack):
    t0, d0 = stack.target_stats(), stack.draft_stats("ngram")
    call = stack.gw["shm"].Generate(req(PROMPTS[1], N_LONG, "ngram"), timeout=60)
    next(call), next(call)
    t1, d1 = stack.target_stats(), stack.draft_stats("ngram")
    assert (t1.shm_channels, d1.shm_channels) == (t0.shm_channels + 1, d0.shm_channels + 1)  # on shared memory
    assert t1.active_sessions == 1 and d1.active_sessions == 1
    started = time.monotonic()
    call.cancel()
    wait_until(
        lambda: stack.target_stats().active_sessions == 0 and stack.draft_stats("ngram").active_sessions == 0,
        1.0,
        "both services freed the cancelled session",
    )
    assert time.monotonic() - started < 1.0
    _, _, code, _ = generate(stack, "shm", req(PROMPTS[2], N_LONG, "ngram"), timeout=0.3)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(
        lambda: stack.target_stats().active_sessions == 0 and stack.draft_stats("ngram").active_sessions == 0,
        2.0,
        "both services freed the session after its deadline",
    )
    wait_no_names(stack)


SAMPLE_PROMPT = [5, 17, 99, 5, 17, 3, 42, 7, 5, 17]
N_SAMPLES, POS = 300, 3


def sample(stack: Stack, draft: str, temperature: float, seed0: int) -> tuple[Counter, int]:
    def one(i: int):
        r = req(SAMPLE_PROMPT, POS + 1, draft)
        r.sampling.temperature, r.sampling.top_k, r.sampling.seed = temperature, 6, seed0 + i
        return stack.gw["shm"].GenerateUnary(r, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(N_SAMPLES)))
    return Counter(r.token_ids[POS] for r in results), sum(sum(r.final.stats.accepted_per_position) for r in results)


def test_sampled_shm_path_follows_the_target(stack):
    s0 = stack.target_stats()
    spec, accepted = sample(stack, "model", 1.5, 0)
    assert stack.target_stats().shm_steps - s0.shm_steps >= N_SAMPLES  # these steps went through shared memory
    ref, _ = sample(stack, "none", 1.5, 10_000)
    control, _ = sample(stack, "none", 0.4, 20_000)
    assert accepted > N_SAMPLES // 5
    assert two_sample_pvalue(spec, ref) > 1e-3, (dict(spec), dict(ref))
    assert two_sample_pvalue(control, ref) < 1e-3, (dict(control), dict(ref))  # the test can tell laws apart


# ------------------------------------------------------------------------------------------ faults
def test_drafter_killed_mid_step_goes_on_target_only_losslessly(stack, one_process):
    specs = [(i % len(PROMPTS), "model") for i in range(8)]
    vias = ["shm", "loop"] * 4  # half the gateway's loops, half the target's
    proposals0 = stack.draft_stats("model").shm_proposals

    def kill_draft():
        deadline = time.monotonic() + 30
        while stack.draft_stats("model").shm_proposals < proposals0 + 8 and time.monotonic() < deadline:
            time.sleep(0.01)  # the requests are drafting over shared memory now
        stack.draft_procs["model"].stop(signal.SIGKILL)

    results = run_concurrently(stack, vias, [req(PROMPTS[p], N_NEW, d, k=2) for p, d in specs], 60.0, kill_draft)
    assert [r[2] for r in results] == [None] * len(specs)
    for (p, _), (ids, final, _, seconds) in zip(specs, results):
        assert ids == one_process[p][:N_NEW]
        assert (
            seconds < 5
        )  # the dead drafter is noticed at once (its doorbell's end-of-file), not after the 10 s step timeout
    assert any(r[1].stats.draft_fallback for v, r in zip(vias, results) if v == "shm")
    assert any(r[1].stats.draft_fallback for v, r in zip(vias, results) if v == "loop")
    wait_no_names(stack)


def test_target_killed_mid_step_gives_unavailable_within_the_deadline(stack, one_process):
    deadline_s = 8.0
    specs = [(i % len(PROMPTS), ("ngram", "none")[i % 2]) for i in range(8)]
    vias = ["shm", "shm", "loop", "loop"] * 2  # the gateway's loops and the target's, drafted and not
    steps0 = stack.target_stats().shm_steps

    def kill_target():
        deadline = time.monotonic() + 30
        while stack.target_stats().shm_steps < steps0 + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        stack.target.stop(signal.SIGKILL)

    results = run_concurrently(stack, vias, [req(PROMPTS[p], N_LONG, d) for p, d in specs], deadline_s, kill_target)
    for (p, _), (ids, final, code, seconds) in zip(specs, results):
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert seconds < deadline_s / 2  # at once (the doorbell's end-of-file), not at the deadline
        assert ids == one_process[p][: len(ids)]  # what was streamed before the failure is still exact
    wait_no_names(stack)
