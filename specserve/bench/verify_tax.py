"""The verify-tax curve: how long the target takes to verify k drafted tokens at a fixed context.

For each k: prefill a fixed context of natural text (the prompt set, concatenated), verify the next k
tokens of that text as the drafted block (greedy), release; repeat with the text shifted by one token
(so the routed experts vary), and take the median. The floor under each point is the byte floor of a
step with k + 1 tokens, the measured context and the median distinct experts the step touched.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from specserve.bench.floors import ModelBytes, floor_ms, step_bytes


def token_stream(prompt_token_ids: Sequence[Sequence[int]], length: int) -> list[int]:
    """The prompts' tokens concatenated (cycled) to ``length`` tokens."""
    flat = [t for ids in prompt_token_ids for t in ids]
    if not flat:
        raise ValueError("the prompt set encodes to no tokens")
    return (flat * (length // len(flat) + 1))[:length]


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure_verify_tax(
    engine,
    stream: Sequence[int],
    ks: Sequence[int],
    context: int,
    repeats: int,
    model_bytes: ModelBytes,
    bandwidth: float,
    device: str,
    warmup: int = 1,
    on_sample: Callable[[dict], None] | None = None,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """One point per k: median verify ms (target-measured when reported, else synchronized wall)."""
    from specserve.contract.types import DraftBlock, SamplingParams

    greedy = SamplingParams(temperature=0.0, seed=0)
    cuda = torch.device(device).type == "cuda"
    need = context + max(ks) + warmup + repeats
    if len(stream) < need:
        raise ValueError(f"token stream has {len(stream)} tokens, the sweep needs {need}")
    points = []
    for k in ks:
        ms, wall, experts, sources = [], [], [], set()
        for r in range(warmup + repeats):
            sid = f"verify-tax-{k}-{r}"
            ctx = list(stream[r : r + context])
            block = DraftBlock(token_ids=tuple(stream[r + context : r + context + k]))
            engine.prefill(sid, ctx, greedy, ())
            try:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = engine.verify(sid, block)
                if cuda:
                    torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t0) * 1e3
            finally:
                engine.release(sid)
            if r < warmup:
                continue
            fwd = res.timings.forward_ms
            sources.add("target" if fwd > 0 else "wall")
            ms.append(fwd if fwd > 0 else wall_ms)
            wall.append(wall_ms)
            experts.append(res.experts_touched)
            if on_sample is not None:
                on_sample(
                    {
                        "k": k,
                        "repeat": r - warmup,
                        "context_len": context + 1,
                        "verify_ms": round(ms[-1], 4),
                        "verify_wall_ms": round(wall_ms, 4),
                        "experts_touched": res.experts_touched,
                        "accepted": len(res.accepted_ids),
                    }
                )
            if progress is not None:
                progress()
        med_experts = statistics.median(experts)
        nbytes = step_bytes(model_bytes, k + 1, int(round(med_experts)), context + 1)
        floor = floor_ms(nbytes.total, bandwidth)
        med = statistics.median(ms)
        points.append(
            {
                "k": k,
                "tokens": k + 1,
                "verify_ms_median": round(med, 4),
                "verify_ms_p25": round(_quantile(ms, 0.25), 4),
                "verify_ms_p75": round(_quantile(ms, 0.75), 4),
                "verify_wall_ms_median": round(statistics.median(wall), 4),
                "verify_ms_source": "+".join(sorted(sources)),
                "experts_touched_median": med_experts,
                "floor_bytes": nbytes.total,
                "floor_bytes_by_part": {
                    "dense": nbytes.dense,
                    "embedding": nbytes.embedding,
                    "experts": nbytes.experts,
                    "kv": nbytes.kv,
                },
                "floor_ms": round(floor, 5),
                "floor_fraction": round(floor / med, 4) if med > 0 else None,
            }
        )
    return points
