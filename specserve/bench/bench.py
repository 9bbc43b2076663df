"""`specserve bench`: one command that reproduces every number of BENCHMARKS.md.

Order of a run: environment and copy bandwidth; target engine; each drafter whose checkpoint exists;
target-only first (the greedy reference), then every drafter x (each fixed k of --fixed-k, adaptive
capped at the largest k) x draft-ahead method; the Hugging Face transformers baselines; the verify-tax
sweep; the projection (only with GPU synthetic timings); then summary.json (with the per-drafter
comparison: adaptive against the best fixed k, draft-ahead on against off) and the plots. Single
stream, greedy, fixed seeds, pinned prompts.

Artifacts under --out: steps.jsonl, requests.jsonl, verify_tax.jsonl, summary.json, plots/*.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specserve.bench import plots
from specserve.bench.bandwidth import measure_copy_bandwidth
from specserve.bench.compare import compare_methods
from specserve.bench.config import CHECKPOINT_FREE, BenchConfig, MethodSpec, Skipped, plan_methods
from specserve.bench.environment import environment, load_average
from specserve.bench.model_bytes import model_bytes
from specserve.bench.prompts import load_prompt_set
from specserve.bench.result import make_summary, write_summary
from specserve.bench.summary import summarize_method
from specserve.errors import SpecserveError
from specserve.progress import Progress

WARMUP_TOKENS = 16
# what a drafter or baseline may raise while being built: recorded as "skipped", never fatal
BUILD_ERRORS = (SpecserveError, ImportError, ValueError, OSError, NotImplementedError, RuntimeError, KeyError)


class BenchError(SpecserveError):
    """The benchmark cannot run (no tokenizer, no methods, ...)."""


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _write_jsonl(path: Path, rows) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def resolve_drafter_checkpoints(config: BenchConfig, skipped: list[Skipped]) -> dict[str, Path]:
    """family -> checkpoint: --draft-models first, then the shipped demo (only for the demo target)."""
    from specserve.paths import demo_checkpoint, shipped_drafter

    found = {}
    for family in config.drafters:
        if family in CHECKPOINT_FREE:  # a folder only when given or shipped (mtp: the demo's layer beside its target)
            folder = config.draft_models.get(family) or (shipped_drafter(family) if config.demo_drafters else None)
            if folder is not None:
                found[family] = folder
            continue
        if family in config.draft_models:
            found[family] = config.draft_models[family]
        elif config.demo_drafters:
            try:
                found[family] = demo_checkpoint(family)
            except SpecserveError as exc:
                skipped.append(Skipped(family, f"no checkpoint: {exc}"))
        else:
            skipped.append(Skipped(family, f"no checkpoint given (--draft-models {family}=DIR)"))
    return found


def build_drafters(config: BenchConfig, engine, checkpoints: dict[str, Path], skipped: list[Skipped]) -> dict:
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer

    proposers = {}
    target_hash = engine.info().vocab_hash
    for family in config.drafters:
        if family == "none" or (family not in CHECKPOINT_FREE and family not in checkpoints):
            continue
        try:
            proposer = build_proposer(
                DrafterConfig(
                    family=family,
                    checkpoint=checkpoints.get(family),
                    target_checkpoint=Path(config.model),  # a demo@ name: the
                    # registry's factories scale the demo's drafters to it (models/scaled_drafters.py)
                    device=config.device,
                    dtype=config.dtype,
                    max_block_size=config.drafter_block_size,
                )
            )
        except BUILD_ERRORS as exc:
            skipped.append(Skipped(family, f"drafter did not build: {_reason(exc)}"))
            continue
        draft_hash = proposer.info.vocab_hash
        if draft_hash and draft_hash != target_hash:
            skipped.append(
                Skipped(family, f"vocabulary {draft_hash[:16]} differs from the target's {target_hash[:16]}")
            )
            continue
        proposers[family] = proposer
    return proposers


def engine_description(engine) -> dict:
    """Which attention / MoE implementations and how many CUDA graphs the engine runs with."""
    model = engine.model
    backend = getattr(model, "attn_backend", None)
    moe = [layer.mlp.experts_fn for layer in model.model.layers if getattr(layer, "is_moe", False)]
    runner = getattr(engine, "runner", None)
    return {
        "attention": type(backend).__name__ if backend is not None else "torch",
        "experts_fn": getattr(moe[0], "__name__", type(moe[0]).__name__) if moe else None,
        "cuda_graphs": len(getattr(runner, "graph_keys", ()) or ()),
        "kv_cache_dtype": str(getattr(getattr(engine, "kv_cache", None), "dtype", "")),
    }


def _model_bytes(engine):
    """Bytes by role of the engine's loaded model; KV entries in the cache's dtype."""
    cache = getattr(engine, "kv_cache", None)
    return model_bytes(engine.model, engine.config, kv_dtype=getattr(cache, "dtype", None))


class _Bench:
    """One run's state: the artifacts folder, the progress bar and the collected results."""

    def __init__(self, config: BenchConfig, progress: bool) -> None:
        self.config = config
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "plots").mkdir(exist_ok=True)
        for name in ("steps.jsonl", "requests.jsonl", "verify_tax.jsonl"):
            (self.out / name).write_text("")
        self.progress = progress
        self.bar = None
        self.skipped: list[Skipped] = []
        self.methods: dict[str, dict] = {}
        self.reference: dict[str, tuple[int, ...]] | None = None
        self.all_steps: list[dict] = []

    def record(self, name: str, results, meta: dict) -> None:
        for r in results:
            _write_jsonl(self.out / "steps.jsonl", r.steps)
            self.all_steps.extend(r.steps)
        _write_jsonl(
            self.out / "requests.jsonl",
            [
                {
                    "method": r.method,
                    "prompt": r.prompt_id,
                    "prompt_tokens": r.prompt_tokens,
                    "completion_tokens": r.completion_tokens,
                    "finish_reason": r.finish_reason,
                    "ttft_s": round(r.ttft_s, 6),
                    "decode_s": round(r.decode_s, 6),
                    "token_ids": list(r.token_ids),
                    "stats": r.stats,
                }
                for r in results
            ],
        )
        self.methods[name] = {**meta, **summarize_method(results, self.reference)}

    def tick(self, label: str) -> None:
        if self.bar is not None:
            self.bar.update(label)


def run_bench(config: BenchConfig, progress: bool = True) -> dict:
    """Run everything, write the artifacts under config.out, return the summary."""
    from specserve.bench.runner import SpecRunner
    from specserve.bench.verify_tax import measure_verify_tax, token_stream
    from specserve.models.loader import load_tokenizer
    from specserve.target_service.factory import EngineConfig, build_engine

    started = time.perf_counter()
    b = _Bench(config, progress)
    tokenizer = load_tokenizer(config.model_folder)
    if tokenizer is None:
        raise BenchError(f"the bench encodes its pinned text prompts: {config.model} needs a tokenizer.json")
    prompt_set = load_prompt_set(config.prompt_set, config.num_prompts)
    prompts = [(p.id, tuple(tokenizer.encode(p.text).ids)) for p in prompt_set.prompts]
    env = environment(config.device)
    bandwidth = measure_copy_bandwidth(config.device, config.copy_bytes)
    env["bandwidth"] = bandwidth.as_dict()
    engine = build_engine(
        EngineConfig(
            model=Path(config.model),
            device=config.device,
            dtype=config.dtype,
            num_kv_blocks=config.num_kv_blocks,
            kv_block_size=config.kv_block_size,
            invariant_steps=config.invariant_steps,
        )
    )
    mb = _model_bytes(engine)
    checkpoints = resolve_drafter_checkpoints(config, b.skipped)
    proposers = build_drafters(config, engine, checkpoints, b.skipped)
    graph_layers = tuple(
        sorted({i for p in proposers.values() if p.info.needs_hidden_states for i in p.info.hidden_layers})
    )
    engine.add_graph_layers(graph_layers)  # (and the served target's: ServedStack passes them on)
    methods, more_skipped = plan_methods(
        config, {f: True for f in proposers}, {f: p.info.needs_hidden_states for f, p in proposers.items()}
    )
    b.skipped.extend(more_skipped)
    if not methods:
        raise BenchError("no method can run: " + "; ".join(f"{s.method}: {s.reason}" for s in b.skipped))
    if methods[0].drafter != "none":  # the greedy reference for the lossless check runs first when asked for
        methods.sort(key=lambda m: m.drafter != "none")
    hf = _build_hf(config, engine, checkpoints, b.skipped)
    hf_methods = hf.methods() if hf is not None else []
    n_runs = len(methods) + len(hf_methods)
    total = n_runs * (len(prompts) + config.warmup) + len(config.k_sweep) * config.tax_repeats
    b.bar = Progress(total, "specserve bench", "run", enabled=progress)  # a bar, or a line every few s off a terminal
    served = None
    if any(v != "process" for v in config.via):
        from specserve.bench.served import ServedStack

        served = ServedStack(config, checkpoints, sorted(proposers), graph_layers=graph_layers)
    try:
        runner = SpecRunner(engine, proposers, config, mb, bandwidth.bytes_per_s, served)
    except BaseException:
        if served is not None:
            served.close()
        raise
    try:
        _run_interleaved(b, _method_runs(config, runner, methods, hf, hf_methods), prompts)
        stream = token_stream(
            [ids for _, ids in _all_prompt_ids(config, tokenizer)],
            config.tax_context + max(config.k_sweep) + config.tax_repeats + 2,
        )
        tax_path = b.out / "verify_tax.jsonl"
        tax = measure_verify_tax(
            engine,
            stream,
            config.k_sweep,
            config.tax_context,
            config.tax_repeats,
            mb,
            bandwidth.bytes_per_s,
            config.device,
            on_sample=lambda row: _write_jsonl(tax_path, [row]),
            progress=lambda: b.tick("verify tax"),
        )
        served_stats = served.service_stats() if served is not None else None
    finally:
        runner.close()
        if served is not None:
            served.close()
        b.bar.close()
    env["load_average_at_end"] = load_average()
    projection = _projection(config, b.methods, b.all_steps)
    from specserve.bench.cost_fit import cost_model_error

    summary = make_summary(
        "e2e",
        config,
        env,
        {
            "prompt_set": {
                "name": prompt_set.name,
                "sha256": prompt_set.sha256,
                "prompts": [{"id": pid, "tokens": len(ids)} for pid, ids in prompts],
            },
            "engine": engine_description(engine),
            "model_bytes": mb.as_dict(),
            "methods": b.methods,
            "comparison": compare_methods({k: v for k, v in b.methods.items() if v.get("via", "process") == "process"}),
            "via": via_comparison(b.methods),
            "served_stats": served_stats,
            "skipped": [s.as_dict() for s in b.skipped],
            "verify_tax": {"context_len": config.tax_context + 1, "repeats": config.tax_repeats, "points": tax},
            "projection": projection,
            "cost_model": cost_model_error(b.all_steps),
            "wall_s": round(time.perf_counter() - started, 3),
        },
    )
    if config.plots:
        summary["plots"] = _plots(b, summary, env)
    write_summary(b.out, summary)
    return summary


def _method_runs(config: BenchConfig, runner, methods: list[MethodSpec], hf, hf_methods) -> list[tuple]:
    """(name, meta, run(prompt_id, prompt_ids, max_new_tokens) -> RequestResult) per method, target-only first."""
    runs = []
    for spec in methods:
        for via in config.via:
            chooser = runner.new_chooser(spec)  # process-wide: kept across the method's warm-up and prompts
            meta = {
                "kind": "specserve",
                "drafter": spec.drafter,
                "speculation": spec.speculation,
                "draft_ahead": spec.draft_ahead,
                "k": spec.k,
                "via": via,
                "base_method": spec.name,
            }
            name = spec.name if via == "process" else f"{spec.name}@{via}"
            runs.append(
                (name, meta, lambda pid, ids, n, spec=spec, c=chooser, via=via: runner.run(spec, pid, ids, c, n, via))
            )
    for m in hf_methods:
        meta = {"kind": "transformers", "drafter": m.name.split("/", 1)[1]}
        runs.append((m.name, meta, lambda pid, ids, n, m=m: hf.run(m, pid, ids, n, config.seed)))
    return runs


def _run_interleaved(b: _Bench, runs: list[tuple], prompts: list[tuple[str, tuple[int, ...]]]) -> None:
    """Warm every method up, then run prompt by prompt, every method on each prompt in turn: slow
    drifts of a shared machine then hit all methods alike instead of whichever ran last."""
    cfg = b.config
    results: dict[str, list] = {name: [] for name, _, _ in runs}
    failed: set[str] = set()

    def attempt(name, meta, fn, pid, ids, n, label):
        if name in failed:
            b.tick(label)
            return None
        torch.manual_seed(cfg.seed)
        try:
            return fn(pid, ids, n)
        except BUILD_ERRORS as exc:
            if meta["kind"] != "transformers":
                raise  # our own stack failing is a bug to surface, not a skipped baseline
            failed.add(name)
            b.skipped.append(Skipped(name, f"transformers generate failed: {_reason(exc)}"))
            return None
        finally:
            b.tick(label)

    for w in range(cfg.warmup):
        pid, ids = prompts[w % len(prompts)]
        for name, meta, fn in runs:
            attempt(name, meta, fn, pid, ids, min(WARMUP_TOKENS, cfg.max_new_tokens), f"{name} warm-up")
    for pid, ids in prompts:
        for name, meta, fn in runs:
            r = attempt(name, meta, fn, pid, ids, cfg.max_new_tokens, name)
            if r is not None:
                results[name].append(r)
    for name, meta, _ in runs:
        if name in failed:
            continue
        b.record(name, results[name], meta)
        if meta.get("drafter") == "none" and meta.get("via", "process") == "process":
            b.reference = {r.prompt_id: r.token_ids for r in results[name]}
            b.methods[name]["matches_target_only"] = 1.0


def via_comparison(methods: dict) -> dict:
    """Per method run more than one way: tokens/s and the per-step phases of each via, and the
    served tokens/s as a fraction of in-process (the issue's 95 % target)."""
    out: dict[str, dict] = {}
    for m in methods.values():
        if m.get("kind") != "specserve" or "base_method" not in m:
            continue
        row = out.setdefault(m["base_method"], {})
        row[m["via"]] = {
            "tokens_per_s": m.get("tokens_per_s"),
            "per_step_ms": m.get("per_step_ms"),
            "matches_target_only": m.get("matches_target_only"),
        }
    for row in out.values():
        base = (row.get("process") or {}).get("tokens_per_s")
        for via, r in row.items():
            if via != "process" and base and r["tokens_per_s"]:
                r["fraction_of_process"] = round(r["tokens_per_s"] / base, 4)
    return {k: v for k, v in out.items() if len(v) > 1}


def _all_prompt_ids(config: BenchConfig, tokenizer):
    """Every prompt of the set (not only the first N): natural text for the verify-tax context."""
    full = load_prompt_set(config.prompt_set)
    return [(p.id, tuple(tokenizer.encode(p.text).ids)) for p in full.prompts]


def _build_hf(config: BenchConfig, engine, checkpoints: dict[str, Path], skipped: list[Skipped]):
    if not config.hf_baselines:
        skipped.append(Skipped("hf/*", "transformers baselines turned off (--no-hf)"))
        return None
    if config.model_folder != Path(config.model):
        skipped.append(Skipped("hf/*", f"{config.model} is built at load time: transformers has no checkpoint of it"))
        return None
    from specserve.bench.hf_baseline import HFBaseline
    from specserve.target_service.factory import DTYPES

    assistant = checkpoints.get("model")
    try:
        hf = HFBaseline(
            Path(config.model),
            config.device,
            DTYPES[config.dtype],
            engine.info().eos_token_ids,
            config.num_speculative_tokens,
        )
    except BUILD_ERRORS as exc:
        skipped.append(Skipped("hf/*", f"transformers could not load {config.model}: {_reason(exc)}"))
        return None
    if assistant is None:
        skipped.append(Skipped("hf/assisted", "no draft LM checkpoint (the 'model' drafter)"))
        return hf
    try:
        hf.load_assistant(assistant)
    except BUILD_ERRORS as exc:
        skipped.append(Skipped("hf/assisted", f"transformers could not load the draft LM {assistant}: {_reason(exc)}"))
    return hf


def _projection(config: BenchConfig, methods: dict, steps: list[dict] = ()) -> dict:
    if config.projection_timings is None:
        return {
            "label": "projection",
            "included": False,
            "reason": "no GPU synthetic-model timings given (--projection-timings FILE)",
        }
    from specserve.bench.projection import load_shape_timings, project_run

    timings = load_shape_timings(config.projection_timings, config.projection_model, config.projection_context)
    out = project_run(timings, methods, steps)
    out["included"] = True
    return out


def plot_tag(model: str, dtype: str, where: str, speculation, fixed_ks, max_k: int) -> str:
    """What every plot's title says of the run: model, dtype, machine, and the speculation modes it ran (fixed's
    k, adaptive's cap: only those of modes that ran)."""
    modes = []
    if "fixed" in speculation:
        modes.append(f"fixed k={','.join(map(str, fixed_ks))}")
    if "adaptive" in speculation:
        modes.append(f"adaptive cap {max_k}")
    return ", ".join([Path(model).name, dtype, where, *modes])


def _plots(b: _Bench, summary: dict, env: dict) -> list[str]:
    where = env["gpu"]["name"] if env.get("gpu") else env["cpu"]
    cfg = b.config
    tag = plot_tag(cfg.model, cfg.dtype, where, cfg.speculation, cfg.fixed_ks, cfg.max_k)
    d = b.out / "plots"
    made = [
        plots.plot_tokens_per_s(b.methods, d / "tokens_per_s.png", f"decode tokens/s ({tag})"),
        plots.plot_verify_tax(
            summary["verify_tax"]["points"],
            summary["model_bytes"]["num_moe_layers"] * summary["model_bytes"]["num_experts"],
            d / "verify_tax.png",
            f"verify tax at context {summary['verify_tax']['context_len']} ({tag})",
            b.all_steps,
        ),
        plots.plot_phase_breakdown(b.methods, d / "phase_breakdown.png", f"per-step phases ({tag})"),
        plots.plot_phase_steps(b.all_steps, d / "phase_steps.png", f"per-step phases, first prompt ({tag})"),
    ]
    if summary["projection"].get("included"):
        made.append(plots.plot_projection(summary["projection"], d / "projection.png"))
    return [str(p.relative_to(b.out)) for p in made]
