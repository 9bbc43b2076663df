"""The skinny GEMM's tiles (kernels/skinny_gemm.py) against cuBLAS (F.linear) at the Moonlight demo's projections,
per call in a CUDA graph that runs every layer's weight once (27 distinct weights, ~600 MB: L2 holds none of them),
for the rows of a census step (4) and of a served invariant step (17). Each tile is checked against F.linear first
(a tile that fails or raises is reported, never best). Run on a GPU:
`python3 -m specserve.bench.skinny_sweep OUT.json` (BENCHMARKS' twelfth pass)."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.bench.gate_sweep import per_call_us

# name -> (N, K): the demo@moonlight-16b-a3b layer's projections (q_a | kv_a merged, q_b, o_proj)
SHAPES = {"q_a+kv_a": (1216 + 576, 2048), "q_b": (16 * 192, 1216), "o_proj": (2048, 2048)}
LAYERS = 27
ROWS = (4, 17)
GRID = {
    "block_n": (16, 32, 64),
    "block_k": (128, 256, 512),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
    "split_k": (1, 2),
}


def per_chain_us(fns: list[Callable[[], object]]) -> float:
    """Median microseconds a call of a graph that runs the calls in turn (gate_sweep.per_call_us over the chain)."""

    def chain() -> None:
        for fn in fns:
            fn()

    return per_call_us(chain, calls=1) / len(fns)


def sweep() -> list[dict]:
    from specserve.kernels.skinny_gemm import SkinnyTile, default_tile, new_counters, skinny_linear

    counters = new_counters("cuda")
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), ROWS):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        mb = n * k * 2 / 1e6
        cublas = per_chain_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)])
        row = {"shape": name, "n": n, "k": k, "rows": m, "mb": round(mb, 2), "cublas_us": round(cublas, 2)}
        row["cublas_tbs"] = round(mb / cublas, 2)
        want = F.linear(x.float(), ws[0].float())
        best = None
        for bn, bk, warps, stages, split in itertools.product(*GRID.values()):
            tile = SkinnyTile(bn, bk, split, warps, stages)
            key = f"n{bn}_k{bk}_w{warps}_s{stages}_x{split}"
            try:
                got = skinny_linear(x, ws[0], counters=counters, tile=tile).float()
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
                    row[key] = "wrong"
                    continue
                us = per_chain_us(
                    [
                        lambda w=w, o=o: skinny_linear(x, w, out=o, counters=counters, tile=tile)
                        for w, o in zip(ws, outs)
                    ]
                )
            except Exception as e:  # noqa: BLE001 - a tile the compiler or the SM cannot hold: reported, not best
                row[key] = f"error: {type(e).__name__}"
                continue
            row[key] = round(us, 2)
            if best is None or us < best[1]:
                best = (key, us)
        row["default"] = str(default_tile(n, k))
        row["best"] = best[0] if best else None
        row["best_us"] = round(best[1], 2) if best else None
        row["best_tbs"] = round(mb / best[1], 2) if best else None
        print(json.dumps({kk: v for kk, v in row.items() if not kk.startswith("n") or kk == "n"}), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    result = sweep()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
