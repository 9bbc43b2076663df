"""A sweep of the W4A16 per-slot GEMV's tile (kernels/quant_gemv.py GemvTile) at Kimi-K2.6 width.

Run on the GPU machine:  specserve bench kernels --suite quant --gemv-sweep [--out DIR]
Shape: 384 experts, H 7168, I 2048, top-8, int4 in groups of 32 (random packed words and bf16 scales, random
routing). For every tile of GRID, at T = 1, 4 and 8 tokens, the gate/up and down kernels are timed apart (gate/up with its
second pass when the tile splits the input, down with the top-k sum that adds the slots and chunks) as the
invariant steps run them: T real rows padded to INVARIANT_ROWS with NO_EXPERT rows (the GEMV's program rows then take
the slots in turn: gemv_lanes). CUDA events around each call, the calls queued behind a device sleep so launch gaps
do not count; median of REPS after WARMUP, cycling over ROUTINGS routings so L2 does not hold the experts. Bytes =
the packed words and scales of the distinct experts the routing touches (floors.int4_linear_bytes), TB/s = bytes /
median time.

Each tile is checked before it may win: (1) the MoE with that tile for both kernels equals the dequantizing
reference (quant_reference.w4a16_moe_reference) within TOL at every T; (2) token-count invariance: the per-slot
rows (gate/up's act, down's fp32 rows) of each 1-row step equal, bit for bit, that row's slots in an
INVARIANT_ROWS-row step (the invariant steps' 17 rows, where the GEMV's program rows take the slots in turn). A
tile that fails a check, or raises, is reported failed and never named best. Best per kernel: the lowest summed
median over BEST_OVER among the tiles that pass.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specserve.bench.floors import int4_linear_bytes
from specserve.bench.kernel_bench import rel_err
from specserve.kernels.quant_gemv import GEMV_TILES, GemvTile, GemvTiles

KERNELS = ("gate_up", "down")
TOKENS = (1, 4, 8)
BEST_OVER = (1, 4)  # decode and a 4-token verify: what the invariant steps run most
INVARIANT_ROWS = 17  # the GPU's invariant row count (graph_max_draft 16 + 1)
TOL = 1e-2  # relative error to the reference, as tests/kernels/test_quant_moe.py's W4A16 cases
ROUTINGS, REPS, WARMUP = 8, 20, 3
# Today's tile first, then the kernels' (kernels/quant_gemv_triton.py) choices at K2.6 width. E = BN * BKW / (32 *
# warps) packed words a thread holds per matrix a step: offline sm_90 builds of the kernels (ptxas register counts and
# the inner loop's instructions per weight) give E = 8: ~96 registers, ~4.5 instructions a weight; E = 16: ~128 and
# ~4.1; E = 32: 240-255 and ~3.9 (some shapes spill); prefetch adds ~40 registers. So: E 8-32 across BN 8-64, BKW
# 16-128 and 1-8 warps; prefetch on E 8 and 16; split 2 / 4 (more programs for a one-token step); lanes 8 (a program
# row per slot up to 8 tokens of a 17-row step, where lanes 4 gives 8 tokens two slots a row).
_T = GemvTile
GRID = (
    _T(16, 64, 2, 1),
    # E = 16
    _T(64, 32, 4, 1),
    _T(32, 64, 4, 1),
    _T(16, 128, 4, 1),
    _T(64, 64, 8, 1),
    _T(32, 32, 2, 1),
    _T(64, 16, 2, 1),
    _T(16, 32, 1, 1),
    _T(32, 16, 1, 1),
    _T(8, 64, 1, 1),
    _T(32, 128, 8, 1),
    _T(32, 32, 2, 2),
    # E = 8
    _T(32, 32, 4, 1),
    _T(64, 16, 4, 1),
    _T(16, 64, 4, 1),
    _T(16, 32, 2, 1),
    _T(8, 32, 1, 1),
    _T(16, 16, 1, 1),
    _T(64, 32, 8, 1),
    # E = 32
    _T(64, 32, 2, 1),
    _T(64, 64, 4, 1),
    _T(64, 16, 1, 1),
    _T(32, 32, 1, 1),
    _T(64, 128, 8, 1),
    # prefetch
    _T(64, 32, 4, 1, prefetch=True),
    _T(32, 64, 4, 1, prefetch=True),
    _T(32, 32, 2, 1, prefetch=True),
    _T(64, 16, 2, 1, prefetch=True),
    _T(32, 32, 4, 1, prefetch=True),
    _T(64, 16, 4, 1, prefetch=True),
    _T(16, 64, 4, 1, prefetch=True),
    _T(16, 32, 2, 1, prefetch=True),
    _T(64, 64, 8, 1, prefetch=True),
    # split
    _T(64, 32, 4, 1, split=2),
    _T(64, 32, 4, 1, split=4),
    _T(32, 32, 4, 1, split=2),
    _T(32, 32, 4, 1, split=4),
    _T(64, 64, 8, 1, split=2),
    _T(32, 32, 2, 1, split=2),
    _T(64, 16, 2, 1, split=4),
    _T(16, 64, 2, 1, split=2),
    _T(64, 32, 2, 1, split=2),
    _T(64, 64, 4, 1, split=4),
    # split and prefetch
    _T(64, 32, 4, 1, split=2, prefetch=True),
    _T(32, 32, 4, 1, split=2, prefetch=True),
    _T(32, 64, 4, 1, split=4, prefetch=True),
    _T(64, 16, 2, 1, split=2, prefetch=True),
    _T(32, 32, 2, 1, split=4, prefetch=True),
    # lanes
    _T(64, 32, 4, 1, lanes=8),
    _T(32, 32, 4, 1, lanes=8),
    _T(64, 32, 4, 1, prefetch=True, lanes=8),
    _T(32, 32, 2, 1, split=2, lanes=8),
    _T(64, 32, 4, 1, lanes=2),
)


@dataclass(frozen=True)
class SweepShape:
    experts: int = 384
    hidden: int = 7168
    inter: int = 2048
    top_k: int = 8
    group: int = 32


K26 = SweepShape()


@dataclass
class Case:
    """The sweep's fixed inputs on one device: weights, per T its routings, and the reference outputs."""

    shape: SweepShape
    dtype: torch.dtype
    weights: tuple  # w13 [E, 2I, H/8], s13 [E, 2I, H/G], w2 [E, H, I/8], s2 [E, H, I/G]
    steps: dict  # T -> list of (x [T, H], ids [T*K], weights [T*K]), ROUTINGS of them (the first one checked)
    timed: dict  # T -> the same steps padded to INVARIANT_ROWS rows with NO_EXPERT rows (what the timing runs)
    refs: dict  # T -> [T, H] reference output of steps[T][0]
    distinct: dict  # T -> mean distinct experts over the routings
    invariant: tuple  # (x [R, H], ids [R*K], weights [R*K]) of the INVARIANT_ROWS-row step


def make_case(
    shape: SweepShape,
    tokens: Sequence[int],
    device: str,
    dtype: torch.dtype,
    routings: int = ROUTINGS,
    invariant_rows: int = INVARIANT_ROWS,
    seed: int = 0,
) -> Case:
    from specserve.kernels.quant_reference import w4a16_moe_reference

    e, h, i, k, g = shape.experts, shape.hidden, shape.inter, shape.top_k, shape.group
    gen = torch.Generator(device=device).manual_seed(seed)

    def words(*s):
        return torch.randint(-(2**31), 2**31 - 1, s, dtype=torch.int32, device=device, generator=gen)

    def scale(rows, cols):  # as the W4A16 tests: activations stay O(1)
        return (torch.rand(e, rows, cols // g, device=device, generator=gen) / (4 * cols**0.5)).bfloat16()

    weights = (words(e, 2 * i, h // 8), scale(2 * i, h), words(e, h, i // 8), scale(h, i))

    def step(t):
        x = torch.randn(t, h, device=device, generator=gen).to(dtype)
        w, ids = torch.topk(torch.softmax(torch.randn(t, e, device=device, generator=gen), -1), k, dim=-1)
        return x, ids.reshape(-1).contiguous(), (w / w.sum(-1, keepdim=True)).reshape(-1).contiguous()

    steps = {t: [step(t) for _ in range(routings)] for t in tokens}
    refs = {
        t: w4a16_moe_reference(x, *weights, ids.view(t, k), w.view(t, k), group_size=g)
        for t, ((x, ids, w), *_) in steps.items()
    }
    distinct = {t: sum(int(torch.unique(s[1]).numel()) for s in ss) / len(ss) for t, ss in steps.items()}
    timed = {t: [_padded(s, invariant_rows, k) for s in ss] for t, ss in steps.items()}
    return Case(shape, dtype, weights, steps, timed, refs, distinct, step(invariant_rows))


def _padded(step, rows: int, k: int):
    """A step of T real rows as an invariant step runs it: rows T.. copy the last row, routed to NO_EXPERT at 0."""
    from specserve.kernels.moe_reference import NO_EXPERT

    x, ids, w = step
    pad = rows - x.shape[0]
    if pad <= 0:
        return step
    return (
        torch.cat([x, x[-1:].expand(pad, -1)]),
        torch.cat([ids, ids.new_full((pad * k,), NO_EXPERT)]),
        torch.cat([w, w.new_zeros(pad * k)]),
    )


def kernel_bytes(shape: SweepShape, kernel: str, experts: float) -> float:
    """Bytes one call must read: the packed words and bf16 scales of the distinct experts it touches."""
    h, i, g = shape.hidden, shape.inter, shape.group
    per_expert = int4_linear_bytes(2 * i, h, g) if kernel == "gate_up" else int4_linear_bytes(h, i, g)
    return experts * per_expert


def check_reference(out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> str | None:
    """None when out equals the reference within tol, else what failed."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    return None if err < tol else f"rel. error {err:.2e} >= {tol:.0e}"


def check_invariant(what: str, full: torch.Tensor, alone: Sequence[torch.Tensor]) -> str | None:
    """full [R*K, C]: a step's per-slot rows; alone[j] [K, C]: row j's slots as a step of its own. None when every
    row's slots are bitwise equal, else which rows differ."""
    k = alone[0].shape[0]
    bad = [j for j, a in enumerate(alone) if not torch.equal(full[j * k : (j + 1) * k], a)]
    return None if not bad else f"{what}: rows {bad} of the {len(alone)}-row step differ from themselves alone"


def _launch(case: Case, step, tiles: GemvTiles):
    """(act [T*K, I], per_slot [T*K, H]) of one step with these tiles."""
    from specserve.kernels.quant_gemv import w4a16_gemv_down, w4a16_gemv_gate_up

    x, ids, w = step
    w13, s13, w2, s2 = case.weights
    act = w4a16_gemv_gate_up(x, w13, s13, ids, w, case.shape.group, tiles.gate_up)
    return act, w4a16_gemv_down(act, w2, s2, ids, w, case.shape.group, tiles.down, x.shape[0])


def check_tiles(case: Case, tiles_at: Callable[[int], GemvTiles]) -> list[str]:
    """The checks of one candidate, whose step of R rows runs tiles_at(R) (a real config: the same tiles at every R;
    the negative control picks them by R). Returns what failed (empty: passed)."""
    from specserve.kernels.quant_moe import w4a16_moe

    failures = []
    for t, ((x, ids, w), *_) in case.steps.items():
        k = case.shape.top_k
        out = w4a16_moe(
            x,
            *case.weights,
            ids.view(t, k),
            w.view(t, k),
            group_size=case.shape.group,
            gemv_max_tokens=t,
            gemv_tiles=tiles_at(t),
        )
        failure = check_reference(out, case.refs[t])
        if failure:
            failures.append(f"T={t}: {failure}")
    x, ids, w = case.invariant
    rows, k = x.shape[0], case.shape.top_k
    full_act, full_out = _launch(case, case.invariant, tiles_at(rows))
    alone = [
        _launch(case, (x[j : j + 1], ids[j * k : (j + 1) * k], w[j * k : (j + 1) * k]), tiles_at(1))
        for j in range(rows)
    ]
    for what, full, parts in (
        ("gate_up act", full_act, [a for a, _ in alone]),
        ("down rows", full_out, [o for _, o in alone]),
    ):
        failure = check_invariant(what, full, parts)
        if failure:
            failures.append(failure)
    return failures


def median_ms(fn: Callable[[int], object], calls: int, cuda: bool, reps: int = REPS, warmup: int = WARMUP) -> float:
    """Median ms of fn(r) over reps calls (r cycling over range(calls)): CUDA events around each call, all queued
    behind a device sleep (only device time counts); on the CPU (the interpreter) wall time."""
    for r in range(warmup):
        fn(r % calls)
    if not cuda:
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            fn(r % calls)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues every call before the device reaches the first
    for r, (start, end) in enumerate(events):
        start.record()
        fn(r % calls)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_tile(case: Case, tile: GemvTile, reps: int = REPS, warmup: int = WARMUP) -> dict:
    """{kernel: {T: {ms, bytes, TBps}}} of one tile, both kernels running it: gate/up with its second pass when split,
    down with the top-k sum (which adds a split tile's chunks)."""
    from specserve.kernels.quant_gemv import w4a16_gemv_down, w4a16_gemv_gate_up, w4a16_gemv_sum

    w13, s13, w2, s2 = case.weights
    g = case.shape.group
    out = {kernel: {} for kernel in KERNELS}
    for t, steps in case.timed.items():
        acts = [_launch(case, s, GemvTiles(tile, tile))[0] for s in steps]
        rows = steps[0][0].shape[0]

        def gate_up(r, steps=steps):
            x, ids, w = steps[r]
            return w4a16_gemv_gate_up(x, w13, s13, ids, w, g, tile)

        def down(r, steps=steps, acts=acts, rows=rows):
            x, ids, w = steps[r]
            return w4a16_gemv_sum(w4a16_gemv_down(acts[r], w2, s2, ids, w, g, tile, rows), ids, rows, x.dtype)

        fns = {"gate_up": gate_up, "down": down}
        for kernel, fn in fns.items():
            ms = median_ms(fn, len(steps), w13.is_cuda, reps, warmup)
            nbytes = kernel_bytes(case.shape, kernel, case.distinct[t])
            out[kernel][t] = {"ms": ms, "bytes": nbytes, "TBps": nbytes / (ms * 1e-3) / 1e12}
    return out


def sweep_row(case: Case, tile: GemvTile, reps: int = REPS, warmup: int = WARMUP) -> dict:
    """One table row: the tile's checks, then (when they pass) its times; an exception fails the row."""
    row = {"config": tile.label(), "tile": dataclasses.asdict(tile), "passed": False, "failures": []}
    try:
        row["failures"] = check_tiles(case, lambda rows: GemvTiles(tile, tile))
        if not row["failures"]:
            row["times"] = time_tile(case, tile, reps, warmup)
            row["passed"] = True
    except Exception as exc:  # a tile Triton cannot compile or run: reported, the sweep goes on
        row["failures"].append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    return row


def best_configs(rows: Sequence[dict], over: Sequence[int] = BEST_OVER) -> dict:
    """{kernel: label of the passing row with the lowest summed ms over `over`} (None when none passes)."""
    best = {}
    for kernel in KERNELS:
        passing = [r for r in rows if r["passed"] and all(t in r["times"][kernel] for t in over)]
        best[kernel] = min(passing, key=lambda r: sum(r["times"][kernel][t]["ms"] for t in over), default=None)
        best[kernel] = best[kernel]["config"] if best[kernel] else None
    return best


def default_line(rows: Sequence[dict], best: dict) -> str | None:
    """The one line of kernels/quant_gemv.py that makes the best tiles the default."""
    tiles = {r["config"]: r["tile"] for r in rows}
    if None in best.values():
        return None
    args = {kernel: GemvTile(**tiles[best[kernel]]).source() for kernel in KERNELS}
    return f"GEMV_TILES = GemvTiles(gate_up={args['gate_up']}, down={args['down']})"


def run_sweep(
    shape: SweepShape = K26,
    tokens: Sequence[int] = TOKENS,
    grid: Sequence[GemvTile] = GRID,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    reps: int = REPS,
    warmup: int = WARMUP,
    routings: int = ROUTINGS,
    invariant_rows: int = INVARIANT_ROWS,
    log=print,
) -> dict:
    start = time.time()
    case = make_case(shape, tokens, device, dtype, routings, invariant_rows)
    rows = []
    for tile in grid:
        rows.append(sweep_row(case, tile, reps, warmup))
        log(
            f"  {tile.label()}: "
            + ("passed" if rows[-1]["passed"] else f"FAILED {rows[-1]['failures']}")
            + f" ({time.time() - start:.1f} s)"
        )
    best = best_configs(rows, [t for t in BEST_OVER if t in tokens] or list(tokens)[:1])
    pair = None  # the two winners together (each passed with itself in both kernels): checked once more
    if None not in best.values():
        tiles = {r["config"]: GemvTile(**r["tile"]) for r in rows}
        pair = check_tiles(case, lambda rows_: GemvTiles(tiles[best["gate_up"]], tiles[best["down"]]))
        log("  best pair: " + ("passed" if not pair else f"FAILED {pair}"))
    return {
        "shape": dataclasses.asdict(shape),
        "tokens": list(tokens),
        "best_over": list(BEST_OVER),
        "tolerance": TOL,
        "invariant_rows": invariant_rows,
        "default": GEMV_TILES.gate_up.label(),
        "rows": rows,
        "best": best,
        "best_pair_failures": pair,
        "best_line": default_line(rows, best) if not pair else None,
        "seconds": time.time() - start,
    }


def run(quick: bool = False, log=print) -> dict:
    """The sweep at K2.6 width on CUDA (the front door refuses a CPU first); quick: no effect (it is one size)."""
    from specserve.bench.kernel_bench import copy_bandwidth

    bw = copy_bandwidth(1 << 30)
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    result = {"copy_bandwidth_Bps": bw, **run_sweep(log=log)}
    return {**result, "table": format_result(result).splitlines()}


def format_result(result: dict) -> str:
    """Per kernel a table: each tile's ms (TB/s) at every T, the summed ms the best is picked by, and its status."""
    tokens, over = result["tokens"], [t for t in result["best_over"] if t in result["tokens"]]
    lines = []
    for kernel in KERNELS:
        head = " ".join(f"{f'T={t} ms (TB/s)':>17}" for t in tokens)
        lines.append(f"{kernel:8} {'config':22} {head} {'sum ' + '+'.join(map(str, over)):>10}  status")
        for r in result["rows"]:
            mark = "*" if result["best"][kernel] == r["config"] else " "
            if r["passed"]:
                cells = " ".join(
                    f"{r['times'][kernel][t]['ms']:9.4f} ({r['times'][kernel][t]['TBps']:4.2f})" for t in tokens
                )
                total = f"{sum(r['times'][kernel][t]['ms'] for t in over):10.4f}"
                status = "best" if mark == "*" else "passed"
            else:
                cells = " ".join(f"{'-':>17}" for _ in tokens)
                total, status = f"{'-':>10}", "FAILED: " + "; ".join(r["failures"])[:160]
            lines.append(f"{mark:8} {r['config']:22} {cells} {total}  {status}")
        lines.append("")
    lines.append(
        f"best: gate_up {result['best']['gate_up']}, down {result['best']['down']} "
        f"(default {result['default']}); {result['seconds']:.1f} s"
    )
    if result.get("best_pair_failures"):
        lines.append(f"the two best together FAILED: {result['best_pair_failures']}")
    if result["best_line"]:
        lines.append(f"to make it the default (kernels/quant_gemv.py): {result['best_line']}")
    return "\n".join(lines)
