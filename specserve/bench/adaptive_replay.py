"""Offline replay of chain-length policies on a bench run's per-step rows (steps.jsonl).

A greedy step that drafted K tokens and accepted a of them would have accepted min(a, k) of its first
k, so the steps of one drafter's fixed run (no draft-ahead) give acceptance samples for every k <= K.
Verify time by tokens in the forward comes from every chain step without draft-ahead (all methods
share the target), draft time by requested k from a table (e.g. the per-step draft ms of k-sweep
runs). ``replay`` then draws steps with common random numbers and scores a policy, fixed k or an
AdaptiveSpeculation driven the way specserve/loop/step_loop.py drives it (its plan: skip or probe, then truncate
the drafted block with its cost sunk). Sequences do not diverge with k here (steps are drawn
independently, or in the order they were recorded: ``order="recorded"`` keeps a run of n-gram matches a run), which is
what makes policies comparable on one recorded run. ``draft_table`` reads the draft ms by k off the drafter's own
fixed rows (the median call of each k, interpolated for a k not run), and ``prompts`` keeps the steps of the
prompts whose name starts with it (``prose-``: the run's prose prompts alone).

    python -m specserve.tools.adaptive_replay OUT/steps.jsonl --drafter model \
        --draft-ms 1=5.14,2=8.02,3=10.45,4=14.07 [--steps 250 --seeds 20]
    python -m specserve.tools.adaptive_replay OUT/steps.jsonl --drafter all --draft-ms auto [--order recorded]
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from specserve.bench.result import read_jsonl
from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation


@dataclass(frozen=True)
class StepModel:
    blocks: tuple[tuple[int, int], ...]  # (drafted, accepted) of greedy steps asking for max_k tokens
    max_k: int
    verify_ms: Mapping[int, tuple[float, ...]]  # tokens in the forward -> measured ms
    experts: Mapping[int, float]  # tokens in the forward -> mean distinct experts
    draft_ms: Mapping[int, float]  # requested k -> mean ms of the draft call

    def __post_init__(self) -> None:
        if not self.blocks or not self.verify_ms:
            raise ValueError("the step model needs acceptance samples and verify times")
        missing = [k for k in range(1, self.max_k + 1) if k not in self.draft_ms]
        if missing:
            raise ValueError(f"draft_ms lacks k = {missing}")


def _in_process(rows: Iterable[dict], prompts: str | None) -> list[dict]:
    """The in-process, chain rows (a served run's rows of the same method are its ``via`` twins) of the prompts whose
    name starts with ``prompts`` (all when None)."""
    return [
        r
        for r in rows
        if not r.get("tree")
        and r.get("via", "process") == "process"
        and (prompts is None or str(r.get("prompt", "")).startswith(prompts))
    ]


def draft_table(rows: Iterable[dict], drafter: str, max_k: int | None = None) -> dict[int, float]:
    """Draft ms by requested k = 1..max_k (default: the largest fixed k run) from ``drafter``'s fixed, no-ahead
    in-process rows: the median call of each k run, linear between them (flat beyond)."""
    by_k: dict[int, list[float]] = defaultdict(list)
    for r in _in_process(rows, None):
        if r["drafter"] == drafter and r["speculation"] == "fixed" and not r["draft_ahead"] and r["draft_ms"] > 0:
            by_k[int(r["k"])].append(float(r["draft_ms"]))
    if not by_k:
        raise ValueError(f"no fixed, no-ahead steps of drafter {drafter!r}")
    ks = sorted(by_k)
    top = max(ks) if max_k is None else max_k
    medians = [float(np.median(by_k[k])) for k in ks]
    return {k: float(np.interp(k, ks, medians)) for k in range(1, top + 1)}


def drafters(rows: Iterable[dict]) -> list[str]:
    """The drafters with fixed, no-ahead in-process rows."""
    return sorted(
        {r["drafter"] for r in _in_process(rows, None) if r["speculation"] == "fixed" and r["drafter"] != "none"}
    )


def step_model(
    rows: Iterable[dict], drafter: str, draft_ms: Mapping[int, float], prompts: str | None = None
) -> StepModel:
    """The step model of ``drafter`` from steps.jsonl rows (its fixed, no-ahead method of the largest k, in process;
    ``prompts``: only the prompts whose name starts with it)."""
    rows = _in_process(rows, prompts)
    verify, experts = defaultdict(list), defaultdict(list)
    for r in rows:
        if not r["draft_ahead"]:
            verify[r["drafted"] + 1].append(float(r["verify_ms"]))
            experts[r["drafted"] + 1].append(float(r["experts_touched"]))
    own = [r for r in rows if r["drafter"] == drafter and r["speculation"] == "fixed" and not r["draft_ahead"]]
    if not own:
        raise ValueError(f"no fixed, no-ahead steps of drafter {drafter!r}")
    max_k = max(r["drafted"] for r in own)
    if any("k" in r for r in own):  # the largest fixed k's own steps, in their recorded order
        top = max(int(r.get("k", 0)) for r in own)
        own = [r for r in own if int(r.get("k", top)) == top]
    # a step that drafted fewer than max_k with draft time spent: the drafter proposed no more (ngram)
    blocks = tuple((r["drafted"], r["accepted"]) for r in own if r["drafted"] == max_k or r["draft_ms"] > 0)
    return StepModel(
        blocks,
        max_k,
        {n: tuple(v) for n, v in verify.items()},
        {n: float(np.mean(v)) for n, v in experts.items()},
        dict(draft_ms),
    )


@dataclass(frozen=True)
class ReplayResult:
    tokens_per_s: float
    mean_accepted_length: float
    chosen_k: dict[int, int]


def _verify_ms(model: StepModel, n: int, u: float) -> float:
    near = min(model.verify_ms, key=lambda m: abs(m - n))
    return float(np.quantile(model.verify_ms[near], u))


ORDERS = ("drawn", "recorded")


def replay(
    model: StepModel, policy: int | AdaptiveSpeculation, steps: int = 5000, seed: int = 0, order: str = "drawn"
) -> ReplayResult:
    """Score a fixed k (an int) or an adaptive chooser on ``steps`` steps: drawn independently, or (``recorded``) the
    recorded blocks in their order from a drawn start, wrapping around. Driven as specserve/loop/step_loop.py drives
    it: plan, draft, truncate with the draft's cost sunk (a probe verifies at least one token; an empty block is not
    truncated), verify."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    rng = np.random.default_rng(seed)
    idx, us = rng.integers(0, len(model.blocks), steps), rng.random(steps)
    if order == "recorded":
        idx = (idx[0] + np.arange(steps)) % len(model.blocks)
    emitted, total_ms, chosen = 0, 0.0, Counter()
    for i, u in zip(idx, us):
        block_len, accepted = model.blocks[i]
        draft_ms, k, probe = 0.0, policy if isinstance(policy, int) else 0, False
        if not isinstance(policy, int):
            k, probe = policy.plan(model.max_k)  # 0: skip; a probe now and then (ProbePolicy)
        if k > 0:
            draft_ms = model.draft_ms[k]
            if not isinstance(policy, int):
                policy.observe_draft(k, draft_ms, steady=not probe, probe=probe)
                k = policy.choose_k(min(k, block_len), sunk_ms=draft_ms, least=int(probe)) if block_len else 0
        drafted = min(k, block_len)
        acc = min(accepted, drafted)
        verify_ms = _verify_ms(model, drafted + 1, u)
        if not isinstance(policy, int):
            policy.observe_verify(drafted, acc, round(model.experts.get(drafted + 1, 0.0)), verify_ms)
        chosen[drafted] += 1
        emitted += acc + 1
        total_ms += draft_ms + verify_ms
    return ReplayResult(emitted / total_ms * 1e3, emitted / steps, dict(sorted(chosen.items())))


def compare(model: StepModel, steps: int, seeds: int, order: str = "drawn") -> dict[str, float]:
    """Mean tokens/s ratio to target-only (k = 0) over ``seeds`` replays: every fixed k and adaptive."""
    out: dict[str, list[float]] = defaultdict(list)
    for seed in range(seeds):
        base = replay(model, 0, steps, seed, order).tokens_per_s
        for k in range(1, model.max_k + 1):
            out[f"k={k}"].append(replay(model, k, steps, seed, order).tokens_per_s / base)
        chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=model.max_k))
        out["adaptive"].append(replay(model, chooser, steps, seed, order).tokens_per_s / base)
    return {name: round(float(np.mean(v)), 4) for name, v in out.items()}


def load_rows(steps_jsonl: str) -> list[dict]:
    """A bench's steps.jsonl (or steps.jsonl.gz: large committed artifacts are gzipped)."""
    return read_jsonl(steps_jsonl)


def run(
    steps_jsonl: str,
    drafter: str,
    draft_ms: Mapping[int, float] | None,
    steps: int = 250,
    seeds: int = 20,
    order: str = "drawn",
    prompts: str | None = None,
) -> dict:
    """compare() on a bench's steps.jsonl: fixed k and adaptive against target-only. ``draft_ms`` None: the drafter's
    own fixed rows' (``draft_table``); ``drafter`` "all": every drafter with fixed rows, by name."""
    rows = load_rows(steps_jsonl)
    if drafter == "all":
        return {d: run_rows(rows, d, None, steps, seeds, order, prompts) for d in drafters(rows)}
    return run_rows(rows, drafter, draft_ms, steps, seeds, order, prompts)


def run_rows(
    rows: list[dict],
    drafter: str,
    draft_ms: Mapping[int, float] | None,
    steps: int,
    seeds: int,
    order: str = "drawn",
    prompts: str | None = None,
) -> dict[str, float]:
    """``run`` on rows already read."""
    table = draft_table(rows, drafter) if draft_ms is None else draft_ms
    return compare(step_model(rows, drafter, table, prompts), steps, seeds, order)
