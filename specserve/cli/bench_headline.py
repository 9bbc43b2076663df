"""`specserve bench headline`: every row of BENCHMARKS.md's GPU headline table on one H200, one command
(bench/headline.py: the stages and the table). Each stage runs as `specserve bench ...` in a process of its own, its
output in OUT/logs/STAGE.log; a stage that fails is reported and the others still run. Prints the table last and
writes it to OUT/headline.md, with each stage's time and exit status in OUT/headline.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from specserve.errors import SpecserveError

HEARTBEAT_S = 30.0  # seconds between two "still running" lines of a stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out/headline"),
        help="artifacts folder: one folder per stage, logs/, headline.md, headline.json",
    )
    parser.add_argument("--only", default=None, help="comma-separated stage names to run (default: all, in order)")
    parser.add_argument("--dry-run", action="store_true", help="print each stage's command and run nothing")
    parser.add_argument("--table-only", action="store_true", help="print the table from OUT's summaries, run nothing")


def run_headline(args: argparse.Namespace) -> int:
    from specserve.bench.headline import headline_table, stages
    from specserve.progress import Heartbeat

    plan = stages(args.out)
    if args.only is not None:
        wanted = [n.strip() for n in args.only.split(",")]
        unknown = [n for n in wanted if n not in {s.name for s in plan}]
        if unknown:
            raise SpecserveError(f"--only: unknown stage(s) {unknown}; stages: {', '.join(s.name for s in plan)}")
        plan = [s for s in plan if s.name in wanted]
    if args.dry_run:
        for s in plan:
            print("specserve " + " ".join(s.argv) + f"   # {s.name}: {s.what}")
        return 0
    failed = []
    if not args.table_only:
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
        record_path = args.out / "headline.json"
        # a run of some stages (--only) adds to the record of the others, run before into the same folder
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        for i, s in enumerate(plan, 1):
            print(
                f"headline: [{i}/{len(plan)}] {s.name}: {s.what} (log: {args.out / 'logs' / s.name}.log)",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            beat = Heartbeat(every_s=HEARTBEAT_S)
            with open(args.out / "logs" / f"{s.name}.log", "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "specserve.cli.main", *s.argv], stdout=log, stderr=subprocess.STDOUT
                )
                while proc.poll() is None:
                    time.sleep(0.5)
                    beat.beat(f"headline: {s.name} running")
            wall = time.monotonic() - t0
            record[s.name] = {"argv": list(s.argv), "rc": proc.returncode, "wall_s": round(wall, 1)}
            if proc.returncode != 0:
                failed.append(s.name)
            print(
                f"headline: {s.name} {'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'} "
                f"in {wall:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        record["total_wall_s"] = round(sum(r["wall_s"] for n, r in record.items() if n != "total_wall_s"), 1)
        record_path.write_text(json.dumps(record, indent=2) + "\n")
    table = headline_table(args.out)
    (args.out / "headline.md").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "headline.md").write_text(table + "\n")
    print(table)
    if failed:
        print(f"headline: failed stages: {', '.join(failed)} (see {args.out / 'logs'})", file=sys.stderr)
    return 1 if failed else 0
