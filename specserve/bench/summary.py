"""Aggregate per-request results and per-step rows into one summary per method."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from specserve.bench.runner import RequestResult


def acceptance_by_position(steps: Sequence[dict]) -> dict:
    """Per drafted position i (0-based):
    conditional[i] = P(position i accepted | positions < i accepted and i was drafted) (the alpha_i of
    specserve/loop/adaptive.py); marginal[i] = P(position i accepted | i was drafted)."""
    max_k = max((s["drafted"] for s in steps), default=0)
    reached = [0] * max_k
    drafted = [0] * max_k
    accepted = [0] * max_k
    for s in steps:
        for i in range(s["drafted"]):
            drafted[i] += 1
            if i <= s["accepted"]:
                reached[i] += 1
            if i < s["accepted"]:
                accepted[i] += 1
    return {
        "conditional": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "marginal": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
        "drafted_count": drafted,
    }


def _histogram(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _mean(values) -> float | None:
    values = list(values)
    return round(statistics.fmean(values), 6) if values else None


def summarize_method(results: Sequence[RequestResult], reference: dict[str, tuple[int, ...]] | None = None) -> dict:
    """tokens/s over all prompts = sum(completion - 1) / sum(decode seconds) (decode throughput, the
    first token excluded, as in SpecStats); ``reference`` = the target-only outputs, for the greedy
    lossless check (fraction of prompts whose output is identical)."""
    decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in results)
    decode_s = sum(r.decode_s for r in results)
    out = {
        "prompts": len(results),
        "completion_tokens": sum(r.completion_tokens for r in results),
        "decode_s": round(decode_s, 6),
        "tokens_per_s": round(decode_tokens / decode_s, 3) if decode_s > 0 else None,
        "tokens_per_s_per_prompt": [
            round((r.completion_tokens - 1) / r.decode_s, 3) if r.decode_s > 0 and r.completion_tokens > 1 else None
            for r in results
        ],
        "ttft_s_mean": _mean(r.ttft_s for r in results),
        "ttft_s_median": round(statistics.median(r.ttft_s for r in results), 6) if results else None,
        "finish_reasons": _histogram_str(r.finish_reason for r in results),
    }
    if reference is not None:
        same = [r.token_ids == reference.get(r.prompt_id) for r in results if r.prompt_id in reference]
        out["matches_target_only"] = round(sum(same) / len(same), 4) if same else None
    steps = [s for r in results for s in r.steps]
    if not steps:
        return out
    n = len(steps)
    drafted = sum(s["drafted"] for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    wall = sum(s["wall_ms"] for s in steps)
    floor = sum(s["floor_ms"] for s in steps)
    verify = sum(s["verify_ms"] for s in steps)
    out.update(
        {
            "steps": n,
            "mean_accepted_length": round((accepted + n) / n, 4),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            # the drafter's cost per token it drafted (draft ms of all steps over their drafted tokens)
            "draft_ms_per_drafted_token": round(sum(s["draft_ms"] for s in steps) / drafted, 4) if drafted else None,
            "acceptance_by_position": acceptance_by_position(steps),
            "chosen_k": _histogram(s["drafted"] for s in steps),
            "per_step_ms": {
                "wall": round(wall / n, 4),
                "draft": round(sum(s["draft_ms"] for s in steps) / n, 4),
                "verify": round(verify / n, 4),
                "overhead": round(sum(s["overhead_ms"] for s in steps) / n, 4),
                "transport": round(sum(s.get("transport_ms", 0.0) for s in steps) / n, 4),
                "floor": round(floor / n, 5),
            },
            "verify_ms_source": "+".join(sorted({s["verify_ms_source"] for s in steps})),
            "experts_touched_mean": _mean(s["experts_touched"] for s in steps),
            "floor_fraction_of_step": round(floor / wall, 4) if wall > 0 else None,
            "floor_fraction_of_verify": round(floor / verify, 4) if verify > 0 else None,
            "draft_ahead_stats": {
                "hits": sum(r.stats.get("draft_ahead_hits", 0) for r in results),
                "ahead_ms": round(sum(r.stats.get("draft_ahead_ms", 0.0) for r in results), 3),
                "hidden_ms": round(sum(r.stats.get("draft_hidden_ms", 0.0) for r in results), 3),
                # the steps' wait for their block drafted ahead after the verify came back: ahead_ms - wait_ms overlapped
                "wait_ms": round(sum(s.get("ahead_wait_ms", 0.0) for s in steps), 3),
            },
            "draft_fallbacks": sum(bool(r.stats.get("draft_fallback")) for r in results),
        }
    )
    return out


def _histogram_str(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
