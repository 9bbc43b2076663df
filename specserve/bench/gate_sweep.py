"""The router-with-gate kernel's tiles (kernels/router.route_gate) against the float32 gate GEMM + router kernel,
per call in a CUDA graph of 50, at Moonlight's, Qwen3-30B-A3B's and Kimi-K2.6's gate shapes (one and four live rows
of a 4-row step). Run on a GPU: `python3 -m specserve.bench.gate_sweep OUT.json` (BENCHMARKS' eleventh pass)."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

# name -> (experts, hidden, top_k, scoring)
GATES = {"moonlight": (64, 2048, 6, "sigmoid"), "qwen3": (128, 2048, 8, "softmax"), "k26": (384, 7168, 8, "sigmoid")}


def per_call_us(fn: Callable[[], object], calls: int = 50, reps: int = 7) -> float:
    """Median microseconds a call over `reps` replays of a graph of `calls` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def sweep() -> list[dict]:
    from specserve.kernels.router import GateTile, RouterConfig, default_gate_tile, new_gate_counters, route, route_gate

    rows = []
    for name, (e, h, k, scoring) in GATES.items():
        rule = RouterConfig(
            num_experts=e,
            top_k=k,
            scoring=scoring,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        x = torch.randn(4, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) / h**0.5
        w32 = w.float()
        bias = torch.randn(e, device="cuda") * 0.1 if scoring == "sigmoid" else None
        counters = new_gate_counters("cuda")
        for live_n in (1, 4):
            live = torch.tensor([live_n], device="cuda")

            def two_launches():
                logits = F.linear(x.float(), w32) if scoring == "sigmoid" else F.linear(x, w)
                return route(logits, rule, bias, live_rows=live, shared=2)

            row = {"case": name, "live": live_n, "two_launch_us": round(per_call_us(two_launches), 2)}
            row["default"] = str(default_gate_tile(e, h))
            for eb in (1, 2, 4, 8, 16):
                for warps in (2, 4, 8):
                    tile = GateTile(eb, min(4096, 8192 // eb, 1 << (h - 1).bit_length()), warps)
                    us = per_call_us(
                        lambda: route_gate(x, w, rule, counters, bias, live_rows=live, shared=2, tile=tile)
                    )
                    row[f"eb{eb}_w{warps}"] = round(us, 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    result = sweep()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
