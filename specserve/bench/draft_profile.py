"""Where a drafter's time goes: `python -m specserve.bench.draft_profile [--drafters eagle3,model,dflash,ngram]`.

For each drafter of the shipped demo, it runs greedy speculative decoding against the demo target (the engine as it
serves: CUDA graphs on a GPU) and times every `Proposer.propose` call on the host clock (its result is read back
inside the call, so the device work is included), then cProfiles a second run of proposes: the host functions by
own time per propose. The verify steps between proposes are not timed or profiled.

Per drafter it prints: proposes timed, median ms per propose and per drafted token, mean accepted length, the
first propose (the catch-up on the whole prompt) apart, and the top host functions. --out writes the rows (JSON).
Runs on the CPU as well (slowly; the figures that matter are the GPU's).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

DRAFTERS = ("eagle3", "model", "dflash", "ngram")
PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\nimport sys\n\n\ndef main():")


def _run(engine, proposer, session_id: str, prompt: list[int], k: int, max_new: int,
         profiler: cProfile.Profile | None) -> tuple[list[float], list[int], list[int]]:
    """(ms per propose, drafted per propose, accepted per propose) of one greedy request."""
    from specserve.contract.types import SamplingParams

    sampling = SamplingParams()
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    pre = engine.prefill(session_id, prompt, sampling, layers)
    seq = list(prompt) + [pre.next_token]
    ms, drafted, accepted = [], [], []
    try:
        proposer.start(session_id, seq, pre.hidden, sampling)
        prefix_len, append_ids, append_hidden = len(seq), (), None
        while len(seq) - len(prompt) < max_new:
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            block = proposer.propose(session_id, prefix_len, append_ids, append_hidden, k)
            if profiler is not None:
                profiler.disable()
            ms.append((time.perf_counter() - t0) * 1e3)
            res = engine.verify(session_id, block)
            drafted.append(len(block))
            accepted.append(len(res.accepted_ids))
            prefix_len = len(seq)
            append_ids = tuple(res.accepted_ids) + (res.next_token,)
            append_hidden = res.hidden
            seq.extend(append_ids)
    finally:
        engine.release(session_id)
        proposer.release(session_id)
    return ms, drafted, accepted


def _host_rows(profiler: cProfile.Profile, calls: int, top: int) -> list[dict]:
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls_per_propose": c / calls,
             "own_us_per_propose": own / calls * 1e6, "cum_us_per_propose": cum / calls * 1e6}
            for (f, line, name), (_, c, own, cum, _) in rows]


def build_drafter(family: str, args: argparse.Namespace):
    from specserve.draft_service.proposer import DrafterConfig
    from specserve.draft_service.registry import build_proposer
    from specserve.paths import demo_checkpoint

    return build_proposer(DrafterConfig(
        family, checkpoint=None if family == "ngram" else demo_checkpoint(family),
        target_checkpoint=demo_checkpoint("target"), device=args.device, dtype=args.dtype, max_block_size=args.k,
    ))


def profile_drafter(family: str, proposer, engine, args: argparse.Namespace) -> dict:
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    _run(engine, proposer, "warm-up", prompts[0], args.k, 16, None)  # JIT, autotuning, allocator
    ms, drafted, accepted, first = [], [], [], []
    for i, prompt in enumerate(prompts):
        m, d, a = _run(engine, proposer, f"timed-{i}", prompt, args.k, args.max_new_tokens, None)
        first.append(m[0])
        ms += m[1:]
        drafted += d[1:]
        accepted += a[1:]
    profiler = cProfile.Profile()
    calls = len(_run(engine, proposer, "profiled", prompts[0], args.k, args.max_new_tokens, profiler)[0])
    per_token = [t / d for t, d in zip(ms, drafted) if d]
    return {
        "drafter": family, "k": args.k, "device": args.device, "dtype": args.dtype, "proposes": len(ms),
        "propose_ms_median": statistics.median(ms) if ms else 0.0,
        "ms_per_drafted_token_median": statistics.median(per_token) if per_token else 0.0,
        "first_propose_ms_mean": statistics.mean(first),
        "mean_accepted_length": 1 + sum(accepted) / max(1, len(accepted)),
        "host_profile": _host_rows(profiler, max(1, calls), args.top),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.bench.draft_profile", description=__doc__.split("\n")[0])
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated drafter families")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per propose")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=("float32", "bfloat16"))
    p.add_argument("--top", type=int, default=15, help="host functions listed per drafter")
    p.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = p.parse_args(argv)
    families = [f for f in args.drafters.split(",") if f]
    bad = [f for f in families if f not in DRAFTERS]
    if bad or not families:
        p.error(f"--drafters: choose from {', '.join(DRAFTERS)}, got {args.drafters!r}")
    if args.k < 1 or args.max_new_tokens < 2:
        p.error("--k must be >= 1 and --max-new-tokens >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is visible")
    from specserve.paths import demo_checkpoint
    from specserve.target_service.factory import EngineConfig, build_engine

    engine = build_engine(EngineConfig(model=demo_checkpoint("target"), device=args.device, dtype=args.dtype,
                                       num_kv_blocks=512))
    proposers = {f: build_drafter(f, args) for f in families}
    # the target's graphs also return the hidden layers EAGLE-3 / DFlash read (as the bench and `generate` do)
    engine.add_graph_layers(sorted({i for d in proposers.values() if d.info.needs_hidden_states
                                    for i in d.info.hidden_layers}))
    rows = [profile_drafter(f, d, engine, args) for f, d in proposers.items()]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
    for r in rows:
        print(f"\n{r['drafter']} k={r['k']} ({r['device']}, {r['dtype']}): {r['propose_ms_median']:.3f} ms per propose, "
              f"{r['ms_per_drafted_token_median']:.3f} ms per drafted token, mean accepted length "
              f"{r['mean_accepted_length']:.2f}, first propose {r['first_propose_ms_mean']:.2f} ms, "
              f"{r['proposes']} proposes")
        for h in r["host_profile"]:
            print(f"    host {h['own_us_per_propose']:7.1f} us own {h['cum_us_per_propose']:8.1f} us cum "
                  f"x{h['calls_per_propose']:.1f}  {h['function'][:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
