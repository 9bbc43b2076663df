"""The W4A16 GEMV tile sweep (bench/gemv_sweep.py): its checks reject wrong results and a tile picked by the row
count (the negative controls), a failed tile is never named best, and the sweep runs end to end on tiny shapes
(CUDA, or the CPU under TRITON_INTERPRET=1 in fp16 as the kernel tests)."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.bench import gemv_sweep as gs
from specserve.kernels.checks import KernelArgumentError, triton_interpreting
from specserve.kernels.fused_moe import HAS_TRITON
from specserve.kernels.quant_gemv import W4A16_GEMV_MAX_TOKENS, GemvTile, GemvTiles

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
ACT = torch.bfloat16 if HAS_CUDA else torch.float16
runs_triton = pytest.mark.skipif(
    not (HAS_TRITON and (HAS_CUDA or triton_interpreting())), reason="needs triton on CUDA, or TRITON_INTERPRET=1"
)
# down reads 32 words a row (I = 256), so its tile's step (BKW) changes the fp32 sums' order; one slot a token and
# ROWS rows (past W4A16_GEMV_MAX_TOKENS: the program rows take the slots in turn) keep the interpreter quick
TINY = gs.SweepShape(experts=4, hidden=16, inter=256, top_k=1, group=16)
GATE_UP = GemvTile(256, 2)
ROWS = W4A16_GEMV_MAX_TOKENS + 1


def _row(config: str, passed: bool, ms: float) -> dict:
    tile = dict(zip(("bn", "bkw", "warps", "stages"), map(int, config.split(","))))
    times = {
        k: {t: {"ms": ms * t, "bytes": 1e6, "TBps": 1e6 / (ms * t * 1e-3) / 1e12} for t in (1, 4, 8)}
        for k in gs.KERNELS
    }
    return {
        "config": GemvTile(**tile).label(),
        "tile": tile,
        "passed": passed,
        "failures": [] if passed else ["T=1: rel. error 5.00e-02 >= 1e-02"],
        "times": times,
    }


def test_a_failed_tile_is_never_named_best():
    rows = [_row("32,32,4,1", True, 0.3), _row("16,64,4,2", False, 0.1), _row("64,16,8,1", True, 0.2)]
    best = gs.best_configs(rows)
    assert best == {"gate_up": "bn64_bkw16_w8_s1", "down": "bn64_bkw16_w8_s1"}
    line = gs.default_line(rows, best)
    assert line == "GEMV_TILES = GemvTiles(gate_up=GemvTile(64, 16, 8, 1), down=GemvTile(64, 16, 8, 1))"
    result = {
        "tokens": [1, 4, 8],
        "best_over": [1, 4],
        "rows": rows,
        "best": best,
        "best_line": line,
        "default": "bn32_bkw32_w4_s1",
        "seconds": 1.0,
    }
    table = gs.format_result(result)
    failed = [ln for ln in table.splitlines() if "bn16_bkw64_w4_s2" in ln]
    assert len(failed) == 2 and all("FAILED" in ln and not ln.startswith("*") for ln in failed)
    assert sum(ln.startswith("*") and "bn64_bkw16_w8_s1" in ln for ln in table.splitlines()) == 2
    assert gs.best_configs([_row("16,64,4,2", False, 0.1)]) == {"gate_up": None, "down": None}
    assert gs.default_line([_row("16,64,4,2", False, 0.1)], {"gate_up": None, "down": None}) is None


def test_checks_reject_wrong_results():
    ref = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    assert gs.check_reference(ref.half(), ref) is None
    assert "rel. error" in gs.check_reference(ref * 1.05, ref)
    nan = ref.clone()
    nan[1, 2] = float("nan")  # an unwritten element
    assert gs.check_reference(nan, ref) is not None
    assert "shape" in gs.check_reference(ref[:2], ref)
    alone = [ref[j : j + 1].clone() for j in range(3)]
    assert gs.check_invariant("down rows", ref, alone) is None
    alone[2][0, 7] = torch.nextafter(alone[2][0, 7], torch.tensor(1e9))  # one ulp
    assert "rows [2]" in gs.check_invariant("down rows", ref, alone)


def test_gemv_tile_refuses_what_triton_cannot_tile():
    assert GemvTile() == GemvTiles().gate_up == GemvTiles().down  # today's tile: (32, 32), 4 warps, unpipelined
    for bad in (dict(bn=24), dict(bkw=0), dict(warps=3), dict(warps=64), dict(stages=0), dict(split=0), dict(lanes=0)):
        with pytest.raises(KernelArgumentError, match="GemvTile needs"):
            GemvTile(**bad)


def test_gemv_tile_labels_and_source() -> None:
    tile = GemvTile(16, 64, 2, 1, split=4, prefetch=True, lanes=8)
    assert tile.label() == "bn16_bkw64_w2_s1_k4_pf_l8" and GemvTile(16, 64, 2, 1).label() == "bn16_bkw64_w2_s1"
    assert tile.source() == "GemvTile(16, 64, 2, 1, split=4, prefetch=True, lanes=8)"
    assert eval(tile.source()) == tile and eval(GemvTile(8, 128, 1, 1).source()) == GemvTile(8, 128, 1, 1)


@pytest.mark.gpu
@runs_triton
def test_a_tile_picked_by_the_row_count_fails_the_invariance_check():
    """Negative control: a candidate whose 1-row step runs another down tile (BKW 4) than its ROWS-row step (BKW 32)
    sums in another order, and the check says so; the same candidate with one tile passes."""
    case = gs.make_case(TINY, (1,), DEV, ACT, routings=1, invariant_rows=ROWS)
    one, other = GemvTiles(GATE_UP, GemvTile(16, 4)), GemvTiles(GATE_UP, GemvTile(16, 32))
    assert gs.check_tiles(case, lambda rows: one) == []
    failures = gs.check_tiles(case, lambda rows: one if rows == 1 else other)
    assert [f for f in failures if f.startswith("down rows: rows [")], failures


@pytest.mark.gpu
@runs_triton
def test_the_sweep_runs_checks_and_names_the_best_on_tiny_shapes():
    result = gs.run_sweep(
        TINY,
        tokens=(1,),
        grid=(GemvTile(256, 4), GemvTile(256, 32, 2, 2)),
        device=DEV,
        dtype=ACT,
        reps=2,
        warmup=1,
        routings=1,
        invariant_rows=ROWS,
        log=lambda msg: None,
    )
    assert [r["passed"] for r in result["rows"]] == [True, True], [r["failures"] for r in result["rows"]]
    assert set(result["best"].values()) <= {"bn256_bkw4_w4_s1", "bn256_bkw32_w2_s2"}
    assert result["best_pair_failures"] == []
    t1 = result["rows"][0]["times"]["gate_up"][1]
    assert t1["bytes"] == gs.kernel_bytes(TINY, "gate_up", 1.0) and t1["ms"] > 0 and t1["TBps"] > 0
    assert "best: gate_up" in gs.format_result(result) and result["best_line"].startswith("GEMV_TILES = ")
    json.dumps(result)  # summary.json holds it as it is
