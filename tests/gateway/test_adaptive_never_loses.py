"""Adaptive speculation never loses to target-only (issue #30), on the shipped demo model, in process, on CPU
(and, marked gpu, on CUDA in float32).

A drafter whose every propose costs a fixed extra time of 6 or 12 target steps (a real n-gram drafter, registered
through the drafter registry the way a user adds one; 12 is the H200's ratio: 5 ms against the demo's ~0.4 ms
float32 step; at 4 an n-gram accepted in full nearly pays) must be turned off: adaptive drafts nothing on nearly
every step, runs at target-only's tokens/s within 5% (its probes spaced by their cost) and emits target-only's
tokens; so must a short run with a fresh chooser (the H200 bench's 4 + 1 requests), its probes within the budget
in the timed requests. A cheap drafter that is accepted (n-gram on repetitive text) must stay on, and one dear only
on the first use of each shape (a graph captured mid-request) must come back on. Timed runs are interleaved with target-only
runs and compared pair by pair (the median ratio), so drift of a shared 2-core machine hits both alike; the first-use
test runs the loop on a clock it owns (OwnClock), its costs in steps whatever the machine's load.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import threading
import time
from types import MappingProxyType

import pytest
import torch

from specserve.contract.types import GenerationRequest
from specserve.draft_service import registry
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.ngram import NgramProposer
from specserve.loop import step_loop, step_observer
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
from specserve.loop.local import LocalDraft, LocalTarget
from specserve.loop.probing import ProbePolicy
from specserve.loop.step_loop import FinalEvent, run_request
from specserve.paths import demo_dir
from specserve.target_service.factory import EngineConfig, build_engine

# the first-use drafter's test, on its own clock (OwnClock): a target step of STEP_MS + STEP_MS_PER_TOKEN a drafted
# token (the demo's float32 CPU step on a quiet machine), a propose of DRAFT_MS, and the first propose of each shape
# FIRST_USE_STEPS steps more (the quiet CPU's 0.25 s against ~10 ms steps; the H200's 50 ms against ~0.4 ms is 125,
# the same path)
STEP_MS, STEP_MS_PER_TOKEN, DRAFT_MS = 10.0, 1.2, 0.1
FIRST_USE_STEPS = 25
NEW_TOKENS = {"cpu": 32, "cuda": 128}
DEAR_TOKENS = {"cpu": 24, "cuda": 128}  # of each timed request of the dear drafter's test
PAIRS = 8  # timed (target-only, adaptive) pairs of one attempt
ATTEMPTS = 3
CODE_PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description="
REPEAT_PROMPT = "import os\nimport sys\nimport re\nimport json\nimport time\n"  # the demo then repeats "import time"


class SlowNgram(NgramProposer):
    """The n-gram drafter with a fixed extra cost per propose: real proposals, a dear drafter."""

    def __init__(self, config: DrafterConfig, extra_s: float) -> None:
        super().__init__(config)
        self.extra_s = extra_s

    def _draft_chain(self, state, num_tokens):
        time.sleep(self.extra_s)
        return super()._draft_chain(state, num_tokens)


class BusyNgram(NgramProposer):
    """The n-gram drafter with a fixed extra CPU time per propose (a busy loop on its thread): its cost in CPU
    seconds is the same however busy the machine is, which its sleeping twin's is not in tokens per CPU second."""

    def __init__(self, config: DrafterConfig, extra_s: float) -> None:
        super().__init__(config)
        self.extra_s = extra_s

    def _draft_chain(self, state, num_tokens):
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.extra_s:
            pass
        return super()._draft_chain(state, num_tokens)


class OwnClock:
    """A clock the test owns, standing in for the ``time`` module of the step loop and its observer (the only
    clocks the chooser's draft, verify and step times are read from): only what the test charges moves it, so a
    step's time is the same on a busy machine as on a quiet one. Charged from the event loop and the drafter's
    thread."""

    def __init__(self) -> None:
        self._ms, self._lock = 0.0, threading.Lock()

    def perf_counter(self) -> float:
        with self._lock:
            return self._ms / 1e3

    def charge(self, ms: float) -> None:
        with self._lock:
            self._ms += ms


class OwnClockTarget:
    """The in-process target whose verify of n drafted tokens takes STEP_MS + n * STEP_MS_PER_TOKEN on ``clock``."""

    def __init__(self, inner: LocalTarget, clock: OwnClock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def verify(self, session_id, block):
        result = await self.inner.verify(session_id, block)
        self.clock.charge(STEP_MS + STEP_MS_PER_TOKEN * len(block))
        return result


class FirstUseNgram(NgramProposer):
    """The n-gram drafter whose first propose of each (chain length, shape) is slow, as a drafter that captures a
    CUDA graph per (catch-up size, k) on first use is (EAGLE-3's catch-up + chain graphs): real proposals, dear
    once per shape, mid-request, cheap after. The shape stands in for the catch-up size: len(S) mod 3. Its time is
    charged to ``clock``: DRAFT_MS a propose, FIRST_USE_STEPS target steps more on a shape's first."""

    def __init__(self, config: DrafterConfig, clock: OwnClock) -> None:
        super().__init__(config)
        self.clock, self.seen = clock, set()

    def _draft_chain(self, state, num_tokens):
        shape = (num_tokens, len(state) % 3)
        if shape not in self.seen:
            self.seen.add(shape)
            self.clock.charge(FIRST_USE_STEPS * STEP_MS)
        self.clock.charge(DRAFT_MS)
        return super()._draft_chain(state, num_tokens)


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.fixture(scope="module", params=["cpu", CUDA])
def demo_target(request):
    """(engine, its LocalTarget, device) of the shipped demo target, float32."""
    root = demo_dir()
    if not (root / "target" / "config.json").is_file():
        pytest.skip("no shipped demo_model/ in this checkout")
    engine = build_engine(
        EngineConfig(model=root / "target", device=request.param, num_kv_blocks=256, kv_block_size=16)
    )
    target = LocalTarget(engine)
    yield engine, target, request.param
    target.close()


@pytest.fixture
def no_gc():
    """No garbage collection inside a timing test: with the whole suite's heap a full collection can take tens of
    ms, a fifth of a timed 24-token CPU request, and it lands in one method of a pair (the dear drafter's test
    failed on a quiet machine in the suite, pairs at 0.75-1.07x, and passed alone). One collection before."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _drafter(monkeypatch, family: str, extra_s: float = 0.0, clock: OwnClock | None = None):
    """Build ``family`` through the registry; ``slow-ngram``, ``busy-ngram`` (``extra_s`` dear) and
    ``first-use-ngram`` (on ``clock``) are registered here first, as a user adds a drafter."""
    factories = dict(
        registry.PROPOSER_FACTORIES,
        **{
            "slow-ngram": functools.partial(SlowNgram, extra_s=extra_s),
            "busy-ngram": functools.partial(BusyNgram, extra_s=extra_s),
            "first-use-ngram": functools.partial(FirstUseNgram, clock=clock),
        },
    )
    monkeypatch.setattr(registry, "PROPOSER_FACTORIES", MappingProxyType(factories))
    return LocalDraft(registry.build_proposer(DrafterConfig(family=family, max_block_size=8)))


async def _timed(target, draft, prompt, chooser, new_tokens: int, clock=time.perf_counter) -> tuple[FinalEvent, float]:
    """(final event, decode tokens/s: tokens after the first over the time after the first, on ``clock``)."""
    request = GenerationRequest(prompt, max_new_tokens=new_tokens, num_speculative_tokens=4, adaptive=draft is not None)
    first = final = None
    async for event in run_request(request, target, draft, adaptive=chooser if draft is not None else None):
        first = first or clock()
        if isinstance(event, FinalEvent):
            final = event
    return final, (len(final.token_ids) - 1) / (clock() - first)


def _prompt(engine, text: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text).ids)


@pytest.mark.parametrize("steps", [6, 12])
def test_adaptive_turns_a_dear_drafter_off_and_runs_at_target_only_speed(demo_target, monkeypatch, steps, no_gc):
    """The slow drafter's extra time per propose is ``steps`` target steps (as measured here). Warm-up requests
    run until the chooser has made its two early probes, or 8 ran (specserve/loop/probing.py: the first soon after
    speculation turned off; the second soon after only if the first was forgivable, its k never timed; else when
    the first is paid off; test_adaptive.py checks them), so the attempts see only probes within the budget.
    Each attempt times PAIRS interleaved (target-only, adaptive) pairs, in alternating order, and takes the
    median of the pairs' ratios; a machine busy with other work may spoil an attempt, so up to ATTEMPTS are
    made (probing every 9th step ran at ~0.7x in every attempt)."""
    engine, target, device = demo_target
    n = DEAR_TOKENS[device]
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    prompt = _prompt(engine, CODE_PROMPT)
    # on the CPU every part of a request is CPU work, so tokens per CPU second of this process (all its threads) is
    # its tokens/s on an idle machine, and other processes' load leaves it be (their wall-clock pairs ranged
    # 0.48-1.13x beside a load of ~5 on 2 cores); the drafter's extra cost is CPU time too (busy-ngram). A GPU run's
    # time is the device's: wall clock, on a machine of its own
    clock = time.process_time if device == "cpu" else time.perf_counter
    family = "busy-ngram" if device == "cpu" else "slow-ngram"

    async def attempt(base, draft):
        ratios, chosen = [], {}
        for i in range(PAIRS):
            tps = {}
            for name in ("target-only", "adaptive") if i % 2 else ("adaptive", "target-only"):
                final, tps[name] = await _timed(
                    target, draft if name == "adaptive" else None, prompt, chooser, n, clock
                )
                assert final.token_ids == base.token_ids, name
                if name == "adaptive":
                    for k, count in final.stats.as_dict()["chosen_k"].items():
                        chosen[int(k)] = chosen.get(int(k), 0) + count
            ratios.append(tps["adaptive"] / tps["target-only"])
        return statistics.median(ratios), ratios, chosen

    def probing() -> str:
        return (
            f"{chooser.probing.probes} probes of ~{chooser.probing.probe_ms} ms, every {chooser.probe_interval()} "
            f"skipped steps of ~{chooser.cost.predict(1) + chooser.overhead_ms[0]:.3f} ms"
        )

    async def go():
        base, _ = await _timed(target, None, prompt, None, n)  # warm-up; the reference tokens
        _, tps = await _timed(target, None, prompt, None, n, clock)
        draft = _drafter(monkeypatch, family, steps / tps)
        try:
            for _ in range(8):  # warm-ups: the chooser measures the drafter and makes its early probes
                await _timed(target, draft, prompt, chooser, n)
                if chooser.probing.probes >= 2:
                    break
            for _ in range(ATTEMPTS):
                ratio, ratios, chosen = await attempt(base, draft)
                drafted = sum(chosen.values()) - chosen.get(0, 0)
                assert drafted <= 0.05 * sum(chosen.values()), f"adaptive drafted on {drafted} of {chosen}; {probing()}"
                if ratio >= 0.95:
                    break
            return ratio, ratios
        finally:
            draft.close()

    ratio, ratios = asyncio.run(go())
    assert ratio >= 0.95, (
        f"adaptive / target-only tokens/s: median {ratio:.3f} of {[round(r, 3) for r in ratios]}; {probing()}"
    )


SHORT_RUN = 4  # timed requests of a short run, after one warm-up (the H200 bench's: 4 prompts + 1)
SHORT_TOKENS = {"cpu": 48, "cuda": 64}
SHORT_PAIRS = 3
PROBE_NOISE = 1.5  # the chooser's step ms against the run's measured wall: a busy machine's drift


def test_adaptive_stays_at_target_only_speed_over_a_few_short_requests(demo_target, monkeypatch, no_gc):
    """A short run with a fresh chooser, as the H200 bench runs each method (issue #30: its scaled MTP drafter ran
    at 0.76x of target-only over 4 + 1 requests of 64 tokens, its exploring probes each a catch-up of ~18 target
    steps). The slow drafter's every propose costs 18 target steps: the warm-up request turns it off (its first
    draft calls) and makes its first probe (forgiven as a possible one-off only if its k was never timed), and the
    later probes are charged to the budget, so the timed requests' probes cost at most the budget (0.5% since issue
    #43) of their time, less one probe not yet paid off,
    within PROBE_NOISE (before: two probes of 18 steps in ~190, 10x the budget). Pairs of (target-only, adaptive)
    runs are interleaved in alternating order; their median tokens/s ratio is checked loosely (a shared machine's
    noise). Both are wall-clock figures, so an attempt whose ratio or probe share misses is made again (up to
    ATTEMPTS: a busy machine's spike in one probe's wall time spoilt a whole run before); whether adaptive drafted
    outside its probes is checked in every run."""
    engine, target, device = demo_target
    n = SHORT_TOKENS[device]
    prompt = _prompt(engine, CODE_PROMPT)

    async def run(draft) -> tuple[float, float, AdaptiveSpeculation | None, dict]:
        """(decode tokens/s of the timed requests, their wall ms, the chooser, their probes' ms and count)."""
        chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4)) if draft is not None else None
        base, _ = await _timed(target, draft, prompt, chooser, n)  # warm-up
        spent, probes = (chooser.probing.spent_ms, chooser.probing.probes) if chooser else (0.0, 0)
        tokens, start, chosen = 0, time.perf_counter(), {}
        for _ in range(SHORT_RUN):
            final, _ = await _timed(target, draft, prompt, chooser, n)
            assert final.token_ids == base.token_ids
            tokens += len(final.token_ids)
            for k, count in final.stats.as_dict()["chosen_k"].items():
                chosen[int(k)] = chosen.get(int(k), 0) + count
        wall_s = time.perf_counter() - start
        timed = dict(chosen=chosen)
        if chooser:
            timed.update(probe_ms=chooser.probing.spent_ms - spent, probes=chooser.probing.probes - probes)
        return tokens / wall_s, 1e3 * wall_s, chooser, timed

    async def go():
        await _timed(target, None, prompt, None, n)  # warm-up
        _, tps = await _timed(target, None, prompt, None, n)
        draft = _drafter(monkeypatch, "slow-ngram", 18 / tps)
        try:
            for _ in range(ATTEMPTS):  # a machine busy with other work may spoil an attempt's timing
                ratios, over = [], []
                for i in range(SHORT_PAIRS):
                    out = {}
                    for name in ("target-only", "adaptive") if i % 2 else ("adaptive", "target-only"):
                        out[name] = await run(draft if name == "adaptive" else None)
                    tps_adaptive, wall_ms, chooser, timed = out["adaptive"]
                    # the budget's share of the same run's wall time; the schedule pays a probe off with the
                    # skipped steps after it, so one probe may stand unpaid at the run's end; and the chooser's
                    # step ms (the budget's unit) may lag a busy machine's by up to PROBE_NOISE
                    budget = chooser.config.probe.max_cost_fraction
                    unpaid = (chooser.probing.probe_ms or 0.0) if timed["probes"] else 0.0
                    if timed["probe_ms"] > PROBE_NOISE * budget * wall_ms + unpaid:  # timing: this attempt is spoilt
                        over.append(
                            f"the timed requests' {timed['probes']} probes cost {timed['probe_ms']:.0f} ms of "
                            f"{wall_ms:.0f} ms (one probe: {unpaid:.0f} ms)"
                        )
                    drafted = sum(c for k, c in timed["chosen"].items() if k)
                    assert drafted <= timed["probes"], f"adaptive drafted on {drafted} steps of {timed['chosen']}"
                    ratios.append(tps_adaptive / out["target-only"][0])
                if statistics.median(ratios) >= 0.9 and not over:
                    break
            return ratios, over
        finally:
            draft.close()

    ratios, over = asyncio.run(go())
    assert not over, over
    assert statistics.median(ratios) >= 0.9, f"adaptive / target-only tokens/s: {[round(r, 3) for r in ratios]}"


def _last_of_repeated_requests(demo_target, monkeypatch, family: str, requests: int):
    """The final events of `requests` adaptive requests on REPEAT_PROMPT (one chooser), each checked equal to
    target-only's tokens."""
    engine, target, device = demo_target
    draft = _drafter(monkeypatch, family)
    n = NEW_TOKENS[device]
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    prompt = _prompt(engine, REPEAT_PROMPT)

    async def go():
        base, _ = await _timed(target, None, prompt, None, n)
        finals = [(await _timed(target, draft, prompt, chooser, n))[0] for _ in range(requests)]
        return base, finals

    try:
        base, finals = asyncio.run(go())
    finally:
        draft.close()
    for final in finals:
        assert final.token_ids == base.token_ids
    return finals[-1]


def _drafted_share(final) -> tuple[float, dict]:
    chosen = final.stats.as_dict()["chosen_k"]
    return sum(n for k, n in chosen.items() if int(k) > 0) / sum(chosen.values()), chosen


def test_adaptive_keeps_a_cheap_accepted_drafter_on(demo_target, monkeypatch, no_gc):
    final = _last_of_repeated_requests(demo_target, monkeypatch, "ngram", 2)
    share, chosen = _drafted_share(final)
    assert share >= 0.8, chosen
    assert final.stats.mean_accepted_length > 2.0, final.stats.as_dict()


FIRST_USE_REQUESTS = 8  # at most: the requests until one pays no first-use cost


def test_a_drafter_dear_only_on_first_use_is_turned_back_on(demo_target, monkeypatch):
    """A drafter whose first propose at each shape costs many target steps (a graph captured on first use) and is
    cheap and accepted after: the one-off costs must not keep speculation off. Requests (one chooser) run until one
    pays no first-use cost (at most FIRST_USE_REQUESTS; every shape seen, or none new asked for); that request must
    draft on >= 80% of its steps (the chooser is back at k = 4 on request 2: the first request's one-offs turn it
    off, its forgiven probe and request 2's cheap one turn it on). A chooser that stays off after the one-offs asks
    for no new shape and fails here at once.

    The loop runs on a clock the test owns (OwnClock): target steps and draft calls cost what the module's
    constants say, so the chooser sees the same times, and makes the same choices, on any machine. On the wall clock
    (a sleep of 0.25 s) a busy 2-core machine stretched the target's steps up to 7x (71 ms against 10) and not the
    sleep, and at a first use of 3.2-4.1 steps (issue #45: 2 of 8 runs failed beside 4 busy loops, k = 0 on all 31
    steps of request 2) the third step drafts k = 1 at a new shape (the verify fit knows only 5-token steps then),
    so k = 1 is timed only on a one-off, and the probe at k = 1, at the third k = 1 shape, is charged in full, as a
    probe of a drafter dear on every call must be (tests/loop/test_adaptive.py,
    test_probes_are_spaced_so_their_time_stays_within_the_budget): the next probe comes ~700 skipped steps on."""
    engine, target, device = demo_target
    clock = OwnClock()
    for module in (step_loop, step_observer):
        monkeypatch.setattr(module, "time", clock)
    target = OwnClockTarget(target, clock)
    draft = _drafter(monkeypatch, "first-use-ngram", clock=clock)
    seen = draft.proposer.seen  # the shapes whose first-use cost was paid
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4))
    prompt = _prompt(engine, REPEAT_PROMPT)
    n = NEW_TOKENS[device]

    async def go():
        base, _ = await _timed(target, None, prompt, None, n)
        news = []
        for _ in range(FIRST_USE_REQUESTS):
            before = len(seen)
            final, _ = await _timed(target, draft, prompt, chooser, n)
            assert final.token_ids == base.token_ids
            news.append(len(seen) - before)
            if len(news) >= 2 and news[-1] == 0:
                return final, news
        raise AssertionError(f"every one of {FIRST_USE_REQUESTS} requests met a new shape: {news}")

    try:
        final, news = asyncio.run(go())
    finally:
        draft.close()
    # the chooser read the test's clock: its fitted 1-token step is STEP_MS (on the wall clock it is not, to 0.1%)
    assert chooser.cost.predict(1) == pytest.approx(STEP_MS, rel=1e-3)
    share, chosen = _drafted_share(final)
    assert share >= 0.8, (chosen, f"new shapes by request: {news}", f"{chooser.probing.probes} probes")


class _Recorded:
    """A real drafter whose first drafted token is recorded by the length of S it drafted after."""

    def __init__(self, inner) -> None:
        self.inner, self.info, self.first = inner, inner.info, {}

    def start(self, *args):
        return self.inner.start(*args)

    def release(self, sid):
        return self.inner.release(sid)

    def propose(self, sid, prefix_len, append_ids, append_hidden, k, tree=None):
        block = self.inner.propose(sid, prefix_len, append_ids, append_hidden, k, tree)
        self.first[prefix_len + len(append_ids)] = block.token_ids[:1]
        return block


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark", "mtp", "model"])
def test_a_drafter_that_skipped_steps_catches_up_to_what_an_in_step_one_drafts(demo_target, family):
    """Speculation off with a probe every 3rd step: each probe's drafter was started lazily or missed the
    last 2 steps (their tokens and, for eagle3 / dflash / mtp, their target hidden rows, sent in one call).
    Its greedy draft equals that of the same drafter kept in step by fixed k = 1 at the same S, and the
    output is target-only's."""
    engine, target, device = demo_target
    root = demo_dir()
    if not (root / family / "config.json").is_file():
        pytest.skip(f"no shipped demo_model/{family}/")

    def drafter():
        config = DrafterConfig(
            family=family, checkpoint=root / family, target_checkpoint=root / "target", device=device, max_block_size=8
        )
        return _Recorded(registry.build_proposer(config))

    in_step, skipping = drafter(), drafter()
    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=4, probe=ProbePolicy(min_interval=2, max_interval=2)))
    for _ in range(chooser.config.draft_window):  # drafting is measured ruinous, k settled: off but for the probes
        for k in (1, 4):
            chooser.observe_draft(k, 1e4)
    prompt = _prompt(engine, CODE_PROMPT)

    async def go():
        drafts = LocalDraft(in_step), LocalDraft(skipping)
        try:
            outs = []
            for request, draft in (
                (GenerationRequest(prompt, 56), None),
                (GenerationRequest(prompt, 56, num_speculative_tokens=1), drafts[0]),
                (GenerationRequest(prompt, 56, num_speculative_tokens=4, adaptive=True), drafts[1]),
            ):
                async for event in run_request(request, target, draft, adaptive=chooser):
                    final = event
                outs.append(final)
            return outs
        finally:
            for d in drafts:
                d.close()

    base, fixed, adaptive = asyncio.run(go())
    assert fixed.token_ids == base.token_ids and adaptive.token_ids == base.token_ids
    assert not adaptive.stats.draft_fallback
    assert chooser.probing.probes >= 10 and set(adaptive.stats.as_dict()["chosen_k"]) <= {"0", "1"}
    common = sorted(set(in_step.first) & set(skipping.first))
    assert len(common) >= 5, (sorted(in_step.first), sorted(skipping.first))
    assert [skipping.first[n] for n in common] == [in_step.first[n] for n in common]
