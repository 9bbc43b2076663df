"""Per drafter: adaptive speculation against the best fixed k, and draft-ahead on against off.

Works on any mapping of method name -> method entry that carries ``kind``, ``drafter``,
``speculation``, ``draft_ahead``, ``k`` and ``tokens_per_s``: the measured method summaries of a run
(summary.json ``methods``) or the projection's per-method entries (``projection.per_method``).
"""

from __future__ import annotations

from collections.abc import Mapping


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _ours(methods: Mapping[str, dict]):
    for name, m in methods.items():
        if m.get("kind") == "specserve" and m.get("drafter") not in (None, "none"):
            yield name, m


def adaptive_vs_fixed(methods: Mapping[str, dict], baseline: float | None) -> list[dict]:
    """One row per (drafter, draft-ahead setting), in run order: every fixed k's tokens/s, the best
    fixed k, the adaptive method (its cap and chosen-k histogram), adaptive / best fixed."""
    groups: dict[tuple[str, bool], dict] = {}
    for name, m in _ours(methods):
        g = groups.setdefault((m["drafter"], bool(m.get("draft_ahead"))), {"fixed": [], "adaptive": None})
        if m.get("speculation") == "adaptive":
            g["adaptive"] = (name, m)
        else:
            g["fixed"].append((name, m))
    rows = []
    for (drafter, ahead), g in groups.items():
        fixed = sorted(g["fixed"], key=lambda nm: nm[1].get("k") or 0)
        measured = [(n, m) for n, m in fixed if m.get("tokens_per_s")]
        best = max(measured, key=lambda nm: nm[1]["tokens_per_s"], default=None)
        row: dict = {
            "drafter": drafter,
            "draft_ahead": ahead,
            "fixed_tokens_per_s_by_k": {str(m.get("k")): m.get("tokens_per_s") for _, m in fixed},
            "best_fixed": None,
            "adaptive": None,
            "adaptive_over_best_fixed": None,
        }
        if best is not None:
            name, m = best
            row["best_fixed"] = {
                "method": name,
                "k": m.get("k"),
                "tokens_per_s": m["tokens_per_s"],
                "vs_target_only": _ratio(m["tokens_per_s"], baseline),
            }
        if g["adaptive"] is not None:
            name, m = g["adaptive"]
            tps = m.get("tokens_per_s")
            row["adaptive"] = {
                "method": name,
                "max_k": m.get("k"),
                "tokens_per_s": tps,
                "vs_target_only": _ratio(tps, baseline),
                "chosen_k": m.get("chosen_k", {}),
            }
            row["adaptive_over_best_fixed"] = _ratio(tps, best[1]["tokens_per_s"] if best else None)
        rows.append(row)
    return rows


def _verify_ms(m: dict) -> float | None:
    return (m.get("per_step_ms") or {}).get("verify")


def draft_ahead_on_off(methods: Mapping[str, dict]) -> list[dict]:
    """Each method run both without and with draft-ahead: tokens/s of both, the draft time the draft-ahead run
    spent ahead, hid behind verify and still waited for after it (``draft_ahead_stats``), and the mean verify ms
    of a step in both runs (on one GPU, drafting ahead contends with the verify: its cost shows here)."""
    rows = []
    for name, off in _ours(methods):
        if off.get("draft_ahead"):
            continue
        on = methods.get(name + "/ahead")
        if on is None:
            continue
        stats = on.get("draft_ahead_stats") or {}
        rows.append(
            {
                "method": name,
                "off_tokens_per_s": off.get("tokens_per_s"),
                "on_tokens_per_s": on.get("tokens_per_s"),
                "on_over_off": _ratio(on.get("tokens_per_s"), off.get("tokens_per_s")),
                "ahead_hits": stats.get("hits"),
                "ahead_ms": stats.get("ahead_ms"),
                "hidden_ms": stats.get("hidden_ms"),
                "wait_ms": stats.get("wait_ms"),
                "off_verify_ms": _verify_ms(off),
                "on_verify_ms": _verify_ms(on),
                "steps": on.get("steps"),
            }
        )
    return rows


def compare_methods(methods: Mapping[str, dict], baseline: float | None = None, draft_ahead: bool = True) -> dict:
    """The comparison block. ``baseline`` = target-only tokens/s (default: the ``target-only`` entry);
    ``draft_ahead=False`` leaves out the on/off rows (a projection without draft time cannot show them)."""
    if baseline is None:
        baseline = methods.get("target-only", {}).get("tokens_per_s")
    out = {"target_only_tokens_per_s": baseline, "adaptive_vs_fixed": adaptive_vs_fixed(methods, baseline)}
    if draft_ahead:
        out["draft_ahead"] = draft_ahead_on_off(methods)
    return out


def _num(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _hist(h: Mapping[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in h.items()) or "-"


def format_comparison(comparison: dict, title: str, note: str = "") -> str:
    """Markdown: adaptive against the best fixed k per drafter, then draft-ahead on against off."""
    lines = (
        [f"### {title}", ""]
        + ([note, ""] if note else [])
        + [
            f"target-only: {_num(comparison.get('target_only_tokens_per_s'))} tok/s; (x) = vs target-only; "
            "chosen k = histogram of drafted tokens per step (k:steps)",
            "",
            "| drafter | draft-ahead | tok/s by fixed k | best fixed k | best fixed tok/s | adaptive (cap) tok/s"
            " | adaptive / best fixed | adaptive chosen k |",
            "|---|---|---|---:|---:|---:|---:|---|",
        ]
    )
    for r in comparison["adaptive_vs_fixed"]:
        by_k = " ".join(f"k{k}: {_num(v)}" for k, v in r["fixed_tokens_per_s_by_k"].items()) or "-"
        best, ada = r["best_fixed"], r["adaptive"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["drafter"],
                    "on" if r["draft_ahead"] else "off",
                    by_k,
                    str(best["k"]) if best else "-",
                    f"{_num(best['tokens_per_s'])} ({_x(best['vs_target_only'])})" if best else "-",
                    f"{_num(ada['tokens_per_s'])} ({_x(ada['vs_target_only'])}) (cap {ada['max_k']})" if ada else "-",
                    _x(r["adaptive_over_best_fixed"]),
                    _hist(ada["chosen_k"]) if ada else "-",
                ]
            )
            + " |"
        )
    if comparison.get("draft_ahead"):
        lines += [
            "",
            "| method | tok/s draft-ahead off | tok/s on | on / off | ahead hits / steps | draft ms ahead"
            " | draft ms hidden behind verify | ms waited after verify | verify ms / step off -> on |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in comparison["draft_ahead"]:
            lines.append(
                "| "
                + " | ".join(
                    [
                        r["method"],
                        _num(r["off_tokens_per_s"]),
                        _num(r["on_tokens_per_s"]),
                        _x(r["on_over_off"]),
                        f"{r['ahead_hits']} / {r['steps']}" if r["ahead_hits"] is not None else "-",
                        _num(r["ahead_ms"]),
                        _num(r["hidden_ms"]),
                        _num(r.get("wait_ms")),
                        f"{_num(r.get('off_verify_ms'), '.2f')} -> {_num(r.get('on_verify_ms'), '.2f')}",
                    ]
                )
                + " |"
            )
    return "\n".join(lines)
