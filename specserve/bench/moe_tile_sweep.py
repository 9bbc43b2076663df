"""The fused MoE's decode tiles at a DeepSeek-style block with its shared experts routed (kernels/fused_moe.py,
moe_reference.SharedExperts): Moonlight-16B-A3B's shape (64 experts of 1408 + 2 shared, top 6, H 2048), a 4-row
invariant step with 1 or 4 live rows, per call in a CUDA graph. The gate-up half's tile is swept with the down half
at its default, then the down half's with the best gate-up. Run on a GPU: `python3 -m specserve.bench.moe_tile_sweep OUT.json`."""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from specserve.bench.gate_sweep import per_call_us

# name -> (routed experts, hidden, intermediate, top_k, shared chunks)
BLOCKS = {"moonlight": (64, 2048, 1408, 6, 2)}  # (a smaller block's touched experts would sit in the 50 MB L2)
ROWS = 4
GATE_UP = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (64, 128, 256) for w, s in ((4, 4), (2, 4), (4, 6))]
DOWN = [(bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128, 256) for w, s in ((4, 4), (2, 4), (4, 6))]


def _case(e: int, h: int, i: int, k: int, s: int, live: int):
    from specserve.kernels.moe_reference import NO_EXPERT, SharedExperts

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) * i**-0.5
    shared = None
    if s:
        shared = SharedExperts(
            torch.randn(2 * s * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) * h**-0.5,
            torch.randn(h, s * i, device="cuda", dtype=torch.bfloat16, generator=gen) * i**-0.5,
            s,
        )
    x = torch.randn(ROWS, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k] for _ in range(ROWS)])
    ids = torch.cat([ids, torch.arange(e, e + s, device="cuda").expand(ROWS, s)], 1)
    weights = torch.rand(ROWS, k + s, device="cuda", generator=gen)
    ids[live:], weights[live:] = NO_EXPERT, 0.0
    return x, w13, w2, ids.contiguous(), weights.contiguous(), shared


def sweep() -> list[dict]:
    from specserve.kernels.fused_moe import default_tile_config, fused_moe

    rows = []
    for name, (e, h, i, k, s) in BLOCKS.items():
        for live in (1, ROWS):
            x, w13, w2, ids, weights, shared = _case(e, h, i, k, s, live)
            base = default_tile_config(ROWS, h, i)

            def timed(cfg):  # None: the tile does not compile here (e.g. more shared memory than the SM has)
                try:
                    return round(per_call_us(lambda: fused_moe(x, w13, w2, ids, weights, config=cfg, shared=shared)), 2)
                except Exception as exc:  # noqa: BLE001 - triton's OutOfResources and friends
                    print(f"skip {cfg}: {type(exc).__name__}", flush=True)
                    return None

            row = {"block": name, "live": live, "default": dataclasses.asdict(base), "default_us": timed(base)}
            gu = {}
            for bn, bk, w, st in GATE_UP:
                cfg = dataclasses.replace(base, gu_bn=bn, gu_bk=bk, gu_warps=w, gu_stages=st)
                gu[f"{bn},{bk},{w},{st}"] = timed(cfg)
            best_gu = min((c for c in gu if gu[c] is not None), key=gu.get)
            bn, bk, w, st = map(int, best_gu.split(","))
            with_gu = dataclasses.replace(base, gu_bn=bn, gu_bk=bk, gu_warps=w, gu_stages=st)
            dn = {}
            for bn, bk, w, st in DOWN:
                cfg = dataclasses.replace(with_gu, dn_bn=bn, dn_bk=bk, dn_warps=w, dn_stages=st)
                dn[f"{bn},{bk},{w},{st}"] = timed(cfg)
            best_dn = min((c for c in dn if dn[c] is not None), key=dn.get)
            row.update(gate_up=gu, best_gate_up=best_gu, down=dn, best_down=best_dn, best_us=dn[best_dn])
            print(json.dumps({kk: v for kk, v in row.items() if kk not in ("gate_up", "down")}), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    result = sweep()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
