"""Where a drafter's time goes: `python -m specserve.tools.draft_profile [--model demo|demo@NAME|DIR]
[--drafters eagle3,model,dflash,ngram,mtp]`.

For each drafter of the shipped demo (against `--model demo@NAME`: the demo's drafters scaled to that target,
models/scaled_drafters.py), it runs greedy speculative decoding against the target (the engine as it serves:
CUDA graphs on a GPU) and times every `Proposer.propose` call on the host clock (its result is read back inside the
call, so the device work is included). A second run of proposes goes through the torch profiler (on CUDA: device
kernels and device-to-host copies that start inside a propose, counted per propose and per drafted token) with
torch's sync debug mode on (host synchronisations per propose: every synchronising tensor op warns once); a third
through cProfile (the host functions by own time per propose). The verify steps between proposes are neither timed
nor counted.

Per drafter it prints: proposes timed, median ms per propose and per drafted token, kernels per drafted token, host
syncs and device-to-host copies per propose, mean accepted length, the first propose (the catch-up on the whole
prompt) apart, and the top host functions; `--tree NUM_NODES,TOP_K,DEPTH` profiles EAGLE-2 trees instead of chains.
--out writes the rows (JSON; `ROW_KEYS` is a row's schema). Runs on the
CPU as well (slowly; no kernels there, so the kernel and copy counts are null; the figures that matter are the GPU's).
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import SpecserveError

DRAFTERS = ("eagle3", "model", "dflash", "dspark", "ngram", "mtp")
DEFAULT_DRAFTERS = ("eagle3", "model", "dflash", "dspark", "ngram")
PROMPTS = ("def parse_args(argv):\n", "class Stack:\n    def push(self, x):", "import os\nimport sys\n\n\ndef main():")
ROW_KEYS = (  # one row per drafter (--out); counts are null where they cannot be taken (a CPU)
    "drafter",
    "model",
    "k",
    "tree",
    "device",
    "dtype",
    "proposes",
    "propose_ms_median",
    "ms_per_drafted_token_median",
    "kernels_per_propose",
    "kernels_per_drafted_token",
    "host_syncs_per_propose",
    "dtoh_copies_per_propose",
    "first_propose_ms_mean",
    "mean_accepted_length",
    "host_profile",
)

# around(call) runs one propose call (a zero-argument function) and returns its result
Around = Callable[[Callable[[], object]], object]


def _plain(call: Callable[[], object]) -> object:
    return call()


def _run(
    engine, proposer, session_id: str, prompt: list[int], k: int, max_new: int, around: Around = _plain, tree=None
) -> tuple[list[float], list[int], list[int]]:
    """(ms per propose, drafted per propose, accepted per propose) of one greedy request (chains, or trees of the
    TreeSpec `tree`)."""
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
            args = (session_id, prefix_len, append_ids, append_hidden, k, tree)
            t0 = time.perf_counter()
            block = around(lambda: proposer.propose(*args))
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
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "calls_per_propose": c / calls,
            "own_us_per_propose": own / calls * 1e6,
            "cum_us_per_propose": cum / calls * 1e6,
        }
        for (f, line, name), (_, c, own, cum, _) in rows
    ]


class _DeviceCounts:
    """`around` for a profiled run: each propose inside a `draft_propose` range, under torch's sync debug mode
    (its warnings counted); afterwards the CUDA kernels and device-to-host copies that started inside a propose."""

    RANGE = "draft_propose"

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.syncs = 0

    def __call__(self, call: Callable[[], object]) -> object:
        with warnings.catch_warnings(record=True) as caught, torch.profiler.record_function(self.RANGE):
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                result = call()
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        self.syncs += sum("synchroniz" in str(w.message) for w in caught)
        return result

    def device_events(self, prof) -> tuple[int, int]:
        """(kernels, device-to-host copies) that start inside a propose range (the device is idle between: a propose
        and a verify each end on a read of their result)."""
        ranges = sorted(
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.name == self.RANGE and e.device_type == torch.autograd.DeviceType.CPU
        )
        kernels = copies = 0
        for e in prof.events():
            if e.device_type != torch.autograd.DeviceType.CUDA or e.name == self.RANGE:  # the range's device copy
                continue
            start = e.time_range.start
            if not any(lo <= start <= hi for lo, hi in ranges):
                continue
            if "DtoH" in e.name:
                copies += 1
            elif not e.name.startswith(("Memcpy", "Memset")):
                kernels += 1
        return kernels, copies


def build_drafter(family: str, args: ProfileConfig):
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer
    from specserve.paths import shipped_drafter

    return build_proposer(
        DrafterConfig(
            family,
            checkpoint=shipped_drafter(family),
            target_checkpoint=_target(args.model),
            device=args.device,
            dtype=args.dtype,
            max_block_size=args.k,
        )
    )


def _target(model: str):
    from specserve.paths import demo_checkpoint

    return demo_checkpoint("target") if model == "demo" else model


def _counted_run(engine, proposer, prompt: list[int], args: ProfileConfig) -> dict:
    """Kernels, copies and host syncs of one run of proposes (CUDA), or nulls (a CPU)."""
    cuda = args.device.startswith("cuda")
    counts = _DeviceCounts(cuda)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        _, drafted, _ = _run(engine, proposer, "counted", prompt, args.k, args.max_new_tokens, counts, args.tree)
        if cuda:
            torch.cuda.synchronize()
    calls, tokens = max(1, len(drafted)), max(1, sum(drafted))
    if not cuda:
        return {
            "kernels_per_propose": None,
            "kernels_per_drafted_token": None,
            "host_syncs_per_propose": None,
            "dtoh_copies_per_propose": None,
        }
    kernels, copies = counts.device_events(prof)
    return {
        "kernels_per_propose": kernels / calls,
        "kernels_per_drafted_token": kernels / tokens,
        "host_syncs_per_propose": counts.syncs / calls,
        "dtoh_copies_per_propose": copies / calls,
    }


def profile_drafter(family: str, proposer, engine, args: ProfileConfig) -> dict:
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    _run(engine, proposer, "warm-up", prompts[0], args.k, 16, tree=args.tree)  # JIT, autotuning, allocator, graphs
    ms, drafted, accepted, first = [], [], [], []
    for i, prompt in enumerate(prompts):
        m, d, a = _run(engine, proposer, f"timed-{i}", prompt, args.k, args.max_new_tokens, tree=args.tree)
        first.append(m[0])
        ms += m[1:]
        drafted += d[1:]
        accepted += a[1:]
    counted = _counted_run(engine, proposer, prompts[0], args)
    profiler = cProfile.Profile()

    def profiled(call):
        profiler.enable()
        try:
            return call()
        finally:
            profiler.disable()

    calls = len(_run(engine, proposer, "profiled", prompts[0], args.k, args.max_new_tokens, profiled, args.tree)[0])
    per_token = [t / d for t, d in zip(ms, drafted) if d]
    row = {
        "drafter": family,
        "model": args.model,
        "k": args.k,
        "tree": None if args.tree is None else [args.tree.num_nodes, args.tree.top_k, args.tree.depth],
        "device": args.device,
        "dtype": args.dtype,
        "proposes": len(ms),
        "propose_ms_median": statistics.median(ms) if ms else 0.0,
        "ms_per_drafted_token_median": statistics.median(per_token) if per_token else 0.0,
        **counted,
        "first_propose_ms_mean": statistics.mean(first),
        "mean_accepted_length": 1 + sum(accepted) / max(1, len(accepted)),
        "host_profile": _host_rows(profiler, max(1, calls), args.top),
    }
    assert tuple(row) == ROW_KEYS
    return row


def _count(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


class DraftProfileError(SpecserveError):
    """A setting the profile cannot run with (its message names the flag)."""


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile (tools/draft_profile.py and `specserve bench draft`: the flags)."""

    model: str = "demo"  # demo, demo@NAME[:LAYERS] (its drafters scaled to it) or a checkpoint folder
    drafters: tuple[str, ...] = DEFAULT_DRAFTERS
    k: int = 4  # drafted tokens per propose
    max_new_tokens: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    top: int = 15  # host functions listed per drafter
    tree: object = None  # a TreeSpec: EAGLE-2 trees of this shape instead of chains
    out: Path | None = None  # the rows (JSON)


def run(args: ProfileConfig) -> int:
    """Profile each drafter, print its lines, write the rows to ``args.out``; DraftProfileError for a bad setting."""
    families = list(args.drafters)
    bad = [f for f in families if f not in DRAFTERS]
    if bad or not families:
        raise DraftProfileError(f"--drafters: choose from {', '.join(DRAFTERS)}, got {','.join(args.drafters)!r}")
    if args.k < 1 or args.max_new_tokens < 2:
        raise DraftProfileError("--k must be >= 1 and --max-new-tokens >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftProfileError("--device cuda: no CUDA GPU is visible")
    from specserve.models.errors import ModelConfigError
    from specserve.models.model_names import resolve_model
    from specserve.target_service.factory import EngineConfig, build_engine

    try:
        resolve_model(_target(args.model))
    except (ModelConfigError, ValueError) as e:
        raise DraftProfileError(f"--model {args.model}: {e}")
    engine = build_engine(
        EngineConfig(model=_target(args.model), device=args.device, dtype=args.dtype, num_kv_blocks=512)
    )
    proposers = {f: build_drafter(f, args) for f in families}
    chains_only = [f for f, d in proposers.items() if args.tree is not None and not d.info.supports_tree]
    if chains_only:
        raise DraftProfileError(f"--tree: {', '.join(chains_only)} draft chains only")
    # the target's graphs also return the hidden layers EAGLE-3 / DFlash read (as the bench and `generate` do)
    engine.add_graph_layers(
        sorted({i for d in proposers.values() if d.info.needs_hidden_states for i in d.info.hidden_layers})
    )
    rows = [profile_drafter(f, d, engine, args) for f, d in proposers.items()]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=1))
    for r in rows:
        shape = f"k={r['k']}" if r["tree"] is None else "tree " + ",".join(map(str, r["tree"]))
        print(
            f"\n{r['drafter']} {shape} on {r['model']} ({r['device']}, {r['dtype']}): {r['propose_ms_median']:.3f} "
            f"ms per propose, {r['ms_per_drafted_token_median']:.3f} ms per drafted token, "
            f"{_count(r['kernels_per_drafted_token'], '.1f')} kernels per drafted token, "
            f"{_count(r['host_syncs_per_propose'], '.1f')} host syncs and "
            f"{_count(r['dtoh_copies_per_propose'], '.1f')} device-to-host copies per propose, mean accepted length "
            f"{r['mean_accepted_length']:.2f}, first propose {r['first_propose_ms_mean']:.2f} ms, "
            f"{r['proposes']} proposes"
        )
        for h in r["host_profile"]:
            print(
                f"    host {h['own_us_per_propose']:7.1f} us own {h['cum_us_per_propose']:8.1f} us cum "
                f"x{h['calls_per_propose']:.1f}  {h['function'][:80]}"
            )
    return 0
