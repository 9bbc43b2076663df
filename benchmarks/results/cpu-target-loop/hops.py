"""Per-hop split of a served step: serve-shm rows of `bench overhead`, medians (us), + cProfile of the caller's loop."""

import cProfile
import json
import pstats
import statistics
import sys

from specserve.bench import serve_overhead as so
from specserve.paths import demo_checkpoint

ROWS = {}
orig = so._one_request


async def rec(clients, via, drafter, k, prompt, n, tag):
    rows, toks = await orig(clients, via, drafter, k, prompt, n, tag)
    if not tag.startswith("warmup"):
        ROWS.setdefault((drafter, via), []).extend(rows)
    return rows, toks


so._one_request = rec
cfg = so.OverheadConfig(model=str(demo_checkpoint("target")), vias=tuple(sys.argv[1].split(",")), requests=3, rounds=1)
prof = cProfile.Profile()
prof.enable()
res = so.run(cfg)
prof.disable()
prof.dump_stats(sys.argv[2] + ".prof")
med = lambda xs: round(statistics.median(xs) * 1e3, 1) if xs else 0.0
out = {}
for (d, via), rows in ROWS.items():
    out[f"{d}@{via}"] = {
        "steps": len(rows),
        "wall": med([r["wall_ms"] for r in rows]),
        "overhead": med([r["wall_ms"] - r["engine_ms"] - r["draft_ms"] for r in rows]),
        "target_transport": med(
            [r["verify_wall_ms"] - r["verify_service_ms"] for r in rows if r["verify_service_ms"] > 0]
        ),
        "target_service_host": med(
            [r["verify_service_ms"] - r["engine_ms"] for r in rows if r["verify_service_ms"] > 0]
        ),
        "verify_wall_minus_compute": med([r["verify_wall_ms"] - r["engine_ms"] for r in rows]),
        "draft_transport": med([r["draft_wall_ms"] - r["draft_service_ms"] for r in rows if r["draft_wall_ms"] > 0]),
        "draft_service_host": med([r["draft_service_ms"] - r["draft_ms"] for r in rows if r["draft_wall_ms"] > 0]),
        "loop_rest": med([r["wall_ms"] - r["verify_wall_ms"] - r["draft_wall_ms"] for r in rows]),
    }
json.dump(out, open(sys.argv[2] + ".json", "w"), indent=1)
print(json.dumps(out, indent=1))
pstats.Stats(sys.argv[2] + ".prof").sort_stats("tottime").print_stats(25)
