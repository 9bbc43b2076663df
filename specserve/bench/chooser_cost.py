"""The chooser's host time a step (`specserve bench overhead --chooser`): adaptive speculation driven as the step loop
drives it (specserve/loop/step_loop.py: plan, the draft's timing, the verify length's cut from each drafted token's confidence,
the verify's observation), on synthetic timings and acceptances, no model. Per part and per whole step, in us.

The verify fit (every ``refit_every`` steps) lands on one step in 16: the median shows a step without it, the mean
and p90 with it amortised.
"""

from __future__ import annotations

import random
import statistics
import time

PARTS = ("plan", "cut", "observe", "step")


def run(steps: int = 4000, max_k: int = 4, warmup: int = 200, seed: int = 0) -> dict:
    """{part: {median, mean, p90} in us} over ``steps`` timed steps (after ``warmup`` untimed ones)."""
    from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation

    chooser = AdaptiveSpeculation(AdaptiveConfig(max_k=max_k))
    rng = random.Random(seed)
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    clock = time.perf_counter
    for i in range(warmup + steps):
        t0 = clock()
        k, probe = chooser.plan(max_k)
        t1 = clock()
        k = k or max_k  # a skipped step drafts nothing; draft anyway so every step cuts and observes a block
        chooser.observe_draft(k, 0.5 + 0.01 * rng.random(), steady=not probe, probe=probe)
        confidence = [rng.random() for _ in range(k)]
        cut = chooser.choose_k(k, confidence, sunk_ms=0.5, least=int(probe))
        t2 = clock()
        accepted = next((j for j in range(cut) if rng.random() > confidence[j]), cut)
        chooser.observe_verify(
            cut,
            accepted,
            40 + 10 * cut,
            3.0 + 0.2 * cut + 0.1 * rng.random(),
            confidence=confidence[:cut],
            overhead_ms=0.2,
            unverified=confidence[cut:],
        )
        t3 = clock()
        if i >= warmup:
            for part, us in zip(PARTS, ((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t3 - t0) * 1e6)):
                times[part].append(us)
    out = {}
    for part, values in times.items():
        s = sorted(values)
        out[part] = {
            "median": round(statistics.median(s), 1),
            "mean": round(statistics.fmean(s), 1),
            "p90": round(s[int(0.9 * (len(s) - 1))], 1),
        }
    return out


def table(result: dict) -> str:
    lines = ["| part | median us | mean us | p90 us |", "|---|---:|---:|---:|"]
    for part, s in result.items():
        lines.append(f"| {part} | {s['median']} | {s['mean']} | {s['p90']} |")
    return "\n".join(lines)
