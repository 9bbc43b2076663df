"""Per-request speculative-decoding statistics (the glossary of specserve/contract/types.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Accumulates one request's steps. A step = one verify forward; its accepted length = accepted + 1."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    chosen_k: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    draft_fallback: bool = False
    draft_ahead_ms: float = 0.0  # drafter time spent on blocks drafted ahead (overlapping verify)
    draft_ahead_hits: int = 0  # steps whose block had been drafted ahead and was usable
    draft_hidden_ms: float = 0.0  # drafter time hidden behind verify by draft-ahead
    completion_tokens: int = 0

    def first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def record_step(self, num_drafted: int, num_accepted: int) -> None:
        self.steps += 1
        self.drafted += num_drafted
        self.accepted += num_accepted
        self.chosen_k.append(num_drafted)
        while len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        now = time.perf_counter()
        ttft = (self.first_token_at or now) - self.started
        decode_s = now - (self.first_token_at or self.started)
        # tokens after the first one, over the time after the first one (decode throughput)
        tps = (self.completion_tokens - 1) / decode_s if self.completion_tokens > 1 and decode_s > 0 else 0.0
        return {
            "steps": self.steps,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "tokens_per_s": round(tps, 3),
            "ttft_s": round(ttft, 6),
            "draft_ms": round(self.draft_ms, 3),
            "draft_hidden_ms": round(self.draft_hidden_ms, 3),
            "draft_ahead_hits": self.draft_ahead_hits,
            "chosen_k": _histogram(self.chosen_k),
            "draft_fallback": self.draft_fallback,
        }


def _histogram(values: list[int]) -> dict[str, int]:
    """{k: how many steps drafted k tokens}, keys as strings for JSON."""
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))
