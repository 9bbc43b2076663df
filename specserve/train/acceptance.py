"""`specserve train eval-acceptance`: acceptance of each drafter on held-out code prompts, through the
real engine (TargetEngine) and the real proposers (draft_service registry), plus the lossless check.

For every prompt and drafter: prefill, then chains of k drafted tokens verified by the target until at
least ``max_new_tokens`` tokens are emitted. "Accepted length" of a verify step = accepted + 1 (the
recovered or bonus token), averaged over all verify steps of all prompts. Lossless: the first
``max_new_tokens`` emitted tokens equal the target-only greedy output (``TargetEngine.generate_greedy``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specserve.errors import SpecserveError
from specserve.loop.stats import SpecStats

FAMILIES = ("ngram", "model", "eagle3", "dflash", "dspark", "mtp")
CARD_BEGIN = "<!-- acceptance:begin -->"
CARD_END = "<!-- acceptance:end -->"


class AcceptanceError(SpecserveError):
    """Bad eval-acceptance settings (missing checkpoints, no prompts, ...)."""


@dataclass(frozen=True)
class DrafterResult:
    family: str
    prompts: int
    verify_steps: int
    drafted: int
    accepted: int
    mean_accepted_length: float  # (accepted + 1) per verify step
    acceptance_rate: float  # accepted / drafted
    lossless_prompts: int  # prompts whose output equals target-only greedy
    seconds: float
    accepted_per_position: tuple[int, ...] = ()  # [i] = verify steps that accepted drafted token i + 1


def load_prompts(target_dir: Path, tokenizer, limit: int | None) -> list[list[int]]:
    path = target_dir / "heldout_prompts.json"
    if not path.is_file():
        raise AcceptanceError(f"no held-out prompts at {path} (written by `specserve train target`)")
    texts = json.loads(path.read_text())
    if limit is not None:
        texts = texts[:limit]
    prompts = [tokenizer.encode(t).ids for t in texts]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise AcceptanceError(f"{path} holds no usable prompts")
    return prompts


def speculative_greedy(
    engine, proposer, session_id: str, prompt: list[int], k: int, max_new: int, stats: SpecStats
) -> list[int]:
    """Emitted tokens [>= max_new] of one greedy request; every verify step is recorded in ``stats``."""
    from specserve.contract.types import SamplingParams

    sampling = SamplingParams()
    layers = proposer.info.hidden_layers if proposer.info.needs_hidden_states else ()
    pre = engine.prefill(session_id, prompt, sampling, layers)
    seq = list(prompt) + [pre.next_token]
    emitted = [pre.next_token]
    try:
        proposer.start(session_id, seq, pre.hidden, sampling)
        prefix_len, append_ids, append_hidden = len(seq), (), None
        while len(emitted) < max_new:
            block = proposer.propose(session_id, prefix_len, append_ids, append_hidden, k)
            res = engine.verify(session_id, block)
            stats.record_step(len(block), len(res.accepted_ids))
            prefix_len = len(seq)
            append_ids = tuple(res.accepted_ids) + (res.next_token,)
            append_hidden = res.hidden
            seq.extend(append_ids)
            emitted.extend(append_ids)
    finally:
        engine.release(session_id)
        proposer.release(session_id)
    return emitted


def evaluate(
    demo: Path,
    families: list[str],
    k: int,
    max_new: int,
    num_prompts: int | None,
    device: str,
    dtype: str,
    denoise_steps: int | None = None,
) -> dict:
    from specserve.draft_service.drafter_config import DrafterConfig
    from specserve.draft_service.registry import build_proposer
    from specserve.target_service.factory import EngineConfig, build_engine

    target_dir = demo / "target"
    engine = build_engine(EngineConfig(model=target_dir, device=device, dtype=dtype, num_kv_blocks=512))
    if engine.tokenizer is None:
        raise AcceptanceError(f"{target_dir} has no tokenizer.json")
    prompts = load_prompts(target_dir, engine.tokenizer, num_prompts)
    t0 = time.monotonic()
    reference = [engine.generate_greedy(p, max_new) for p in prompts]
    ref_seconds = time.monotonic() - t0
    results = []
    for family in families:
        ckpt = None if family == "ngram" else demo / family
        if ckpt is not None and not (ckpt / "config.json").is_file():
            raise AcceptanceError(f"no {family} checkpoint at {ckpt}")
        proposer = build_proposer(
            DrafterConfig(
                family=family,
                checkpoint=ckpt,
                target_checkpoint=target_dir,
                device=device,
                dtype=dtype,
                max_block_size=k,
                denoise_steps=denoise_steps,
            )
        )
        t0 = time.monotonic()
        stats, lossless = SpecStats(), 0
        for i, (prompt, ref) in enumerate(zip(prompts, reference)):
            out = speculative_greedy(engine, proposer, f"{family}-{i}", prompt, k, max_new, stats)
            lossless += int(out[:max_new] == ref[:max_new])
        results.append(
            DrafterResult(
                family=family,
                prompts=len(prompts),
                verify_steps=stats.steps,
                drafted=stats.drafted,
                accepted=stats.accepted,
                mean_accepted_length=stats.mean_accepted_length,
                acceptance_rate=stats.acceptance_rate,
                lossless_prompts=lossless,
                seconds=round(time.monotonic() - t0, 2),
                accepted_per_position=tuple(stats.accepted_per_position),
            )
        )
    return {
        "k": k,
        "max_new_tokens": max_new,
        "prompts": len(prompts),
        "device": device,
        "dtype": dtype,
        "target_only_seconds": round(ref_seconds, 2),
        "denoise_steps": denoise_steps,
        "results": [asdict(r) for r in results],
    }


def card_table(report: dict) -> str:
    lines = [
        f"k = {report['k']} drafted tokens per step, temperature 0, {report['prompts']} held-out prompts, "
        f"{report['max_new_tokens']} new tokens each ({report['device']}, {report['dtype']})"
        + (f"; dflash with denoise_steps {report['denoise_steps']}." if report.get("denoise_steps") else "."),
        "",
        "| drafter | mean accepted length (accepted + 1) | acceptance rate | steps accepting drafted token 1 / 2 / ... |"
        " verify steps | lossless prompts |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['family']} | {r['mean_accepted_length']:.2f} | {r['acceptance_rate']:.3f} | "
            f"{_position_shares(r)} | {r['verify_steps']} | {r['lossless_prompts']}/{r['prompts']} |"
        )
    return "\n".join(lines)


def _position_shares(result: dict) -> str:
    """Share of verify steps that accepted drafted token i, i = 1..k (they add up to the mean accepted
    length - 1); '-' for a report written before this was recorded."""
    counts = result.get("accepted_per_position") or ()
    steps = max(result["verify_steps"], 1)
    return " / ".join(f"{c / steps:.2f}" for c in counts) or "-"


def write_card(path: Path, report: dict) -> None:
    text = path.read_text()
    if CARD_BEGIN not in text or CARD_END not in text:
        raise AcceptanceError(f"{path} lacks the markers {CARD_BEGIN} / {CARD_END}")
    head, rest = text.split(CARD_BEGIN, 1)
    _, tail = rest.split(CARD_END, 1)
    path.write_text(f"{head}{CARD_BEGIN}\n{card_table(report)}\n{CARD_END}{tail}")
