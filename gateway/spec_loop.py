"""The per-request loop: prefill, then propose -> verify -> stream, until a stop.

One sequence S = prompt + emitted tokens; its last token is the pending token (glossary:
target_service/engine/types.py). The drafter keeps its own copy of S; each propose call tells it how
much of its copy is still confirmed (``prefix_len``) and what to append, so a drafter can never
drift from the target. A drafter failure only drops speculation: the loop goes on target-only, which
is still lossless, and the request is marked ``draft_fallback``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from specserve.gateway import tracing as names
from specserve.gateway.clients import DraftClient, DraftError, TargetClient


class MalformedDraft(DraftError):
    """One drafted block is unusable; that step runs target-only and the drafter is kept."""
from specserve.gateway.detok import IncrementalText
from specserve.gateway.stats import SpecStats
from specserve.target_service.engine.types import DraftBlock, SamplingParams

EMPTY_BLOCK = DraftBlock(token_ids=())


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = 4
    tree: object | None = None  # a TreeSpec for tree drafting
    stop: tuple[str, ...] = ()
    model_name: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class FinalEvent:
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats


def check_block(block: DraftBlock, max_nodes: int, vocab_size: int) -> None:
    """Refuse a malformed drafted block: the step then runs target-only."""
    n = len(block.token_ids)
    if n > max_nodes:
        raise MalformedDraft(f"drafted {n} tokens, asked for at most {max_nodes}")
    if any(not 0 <= t < vocab_size for t in block.token_ids):
        raise MalformedDraft("drafted token id outside the vocabulary")
    if block.probs is not None:
        probs = block.probs
        if tuple(probs.shape) != (n, vocab_size):
            raise MalformedDraft(f"draft probs shape {tuple(probs.shape)}, expected {(n, vocab_size)}")
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
            raise MalformedDraft("draft probs are not a finite non-negative distribution")


class _DraftSync:
    """What the drafter already holds of S, and the target hidden rows it has not been sent yet."""

    def __init__(self, needs_hidden: bool) -> None:
        self.known = 0
        self.needs_hidden = needs_hidden
        self.unsent_hidden: list[torch.Tensor] = []

    def add_hidden(self, rows: torch.Tensor | None) -> None:
        if self.needs_hidden and rows is not None:
            self.unsent_hidden.append(rows)

    def take_hidden(self) -> torch.Tensor | None:
        if not self.needs_hidden or not self.unsent_hidden:
            return None
        rows = torch.cat(self.unsent_hidden, dim=0)
        self.unsent_hidden = []
        return rows


async def run_request(
    request: GenerationRequest,
    target: TargetClient,
    draft: DraftClient | None,
    *,
    tokenizer=None,
    target_info=None,
    session_id: str | None = None,
) -> AsyncIterator[TokenEvent | FinalEvent]:
    """Yield token deltas as they are accepted, then one FinalEvent. Releases both sessions at the end."""
    sid = session_id or uuid.uuid4().hex
    info = target_info or await target.info()
    eos = frozenset(info.eos_token_ids)
    stats = SpecStats()
    text = IncrementalText(tokenizer, request.stop)
    tracer = names.tracer()
    with tracer.start_as_current_span(names.SPAN_REQUEST) as span:
        span.set_attribute(names.ATTR_MODEL, request.model_name or info.model_type)
        span.set_attribute(names.ATTR_INPUT_TOKENS, len(request.prompt_ids))
        draft_info = None
        if draft is not None:
            try:
                draft_info = await draft.info()
                span.set_attribute(names.ATTR_DRAFT_FAMILY, draft_info.family)
            except DraftError:
                draft, stats.draft_fallback = None, True
        hidden_layers = tuple(draft_info.hidden_layers) if draft_info and draft_info.needs_hidden_states else ()
        sync = _DraftSync(needs_hidden=bool(hidden_layers))
        try:
            with tracer.start_as_current_span(names.SPAN_PREFILL):
                pre = await target.prefill(sid, request.prompt_ids, request.sampling, hidden_layers)
            seq = list(request.prompt_ids) + [pre.next_token]
            sync.add_hidden(pre.hidden)
            stats.first_token()
            if draft is not None:
                try:
                    with tracer.start_as_current_span(names.SPAN_DRAFT_START):
                        await draft.start(sid, seq, sync.take_hidden(), request.sampling)
                    sync.known = len(seq)
                except DraftError as exc:
                    draft = _fallback(stats, span, exc)
            emitted: list[int] = []
            finish = None
            new = [pre.next_token]
            while True:
                # --- stream what the last step emitted, stopping at eos, a stop string or the length limit
                with tracer.start_as_current_span(names.SPAN_ACCEPT_STREAM):
                    new, finish = _cut(new, eos, request.max_new_tokens - len(emitted))
                    delta, stopped = text.push(new)
                    emitted.extend(new)
                    stats.completion_tokens = len(emitted)
                    finish = "stop" if stopped else finish
                    if finish is None and len(seq) >= info.max_context:
                        finish = "length"
                if new:
                    yield TokenEvent(tuple(new), delta)
                if finish is not None:
                    break
                remaining = request.max_new_tokens - len(emitted)
                k = max(0, min(request.num_speculative_tokens, remaining - 1, info.max_context - len(seq) - 1))
                # --- propose
                block = EMPTY_BLOCK
                if draft is not None and k > 0:
                    try:
                        with tracer.start_as_current_span(names.SPAN_DRAFT_PROPOSE) as dspan:
                            dspan.set_attribute(names.ATTR_K, k)
                            block = await draft.propose(
                                sid, sync.known, seq[sync.known :], sync.take_hidden(), k, request.tree
                            )
                        sync.known = len(seq)
                        max_nodes = getattr(request.tree, "num_nodes", 0) if request.tree is not None else k
                        check_block(block, max_nodes, info.vocab_size)
                    except MalformedDraft as exc:
                        span.add_event("malformed draft ignored", {"reason": str(exc)[:200]})
                        block = EMPTY_BLOCK
                    except DraftError as exc:
                        draft = _fallback(stats, span, exc)
                        block = EMPTY_BLOCK
                # --- verify
                with tracer.start_as_current_span(names.SPAN_TARGET_VERIFY) as vspan:
                    res = await target.verify(sid, block)
                    vspan.set_attribute(names.ATTR_K, len(block))
                    vspan.set_attribute(names.ATTR_TREE_SIZE, 0 if block.is_chain else len(block))
                    vspan.set_attribute(names.ATTR_ACCEPTED, len(res.accepted_ids))
                    vspan.set_attribute(names.ATTR_FORWARD_MS, res.timings.forward_ms)
                    vspan.set_attribute(names.ATTR_EXPERTS_TOUCHED, res.experts_touched)
                stats.record_step(len(block), len(res.accepted_ids))
                stats.verify_ms += res.timings.forward_ms
                sync.add_hidden(res.hidden)
                new = list(res.emitted)
                seq.extend(new)
            final_text = text.text if tokenizer is not None else None
            span.set_attribute(names.ATTR_OUTPUT_TOKENS, len(emitted))
            span.set_attribute(names.ATTR_FINISH_REASON, finish)
            span.set_attribute(names.ATTR_MEAN_ACCEPTED_LENGTH, stats.mean_accepted_length)
            span.set_attribute(names.ATTR_TTFT_S, (stats.first_token_at or stats.started) - stats.started)
            span.set_attribute(names.ATTR_DRAFT_FALLBACK, stats.draft_fallback)
            yield FinalEvent(tuple(emitted), final_text, finish, len(request.prompt_ids), len(emitted), stats)
        finally:
            await _release(sid, target, draft)


def _cut(new: list[int], eos: frozenset[int], room: int) -> tuple[list[int], str | None]:
    """Trim a step's emitted tokens at the first eos (kept) or at the length limit."""
    for i, t in enumerate(new[:room]):
        if t in eos:
            return new[: i + 1], "eos"
    if len(new) >= room:
        return new[:room], "length"
    return new, None


def _fallback(stats: SpecStats, span, exc: Exception) -> None:
    """Drop the drafter for the rest of the request (returns the new, absent drafter)."""
    stats.draft_fallback = True
    span.add_event("draft fallback", {"reason": str(exc)[:200]})
    return None


async def _release(sid: str, target: TargetClient, draft: DraftClient | None) -> None:
    """Free both sessions; a failure to release must not mask the request's own outcome."""
    for part in (draft, target):
        if part is None:
            continue
        try:
            await part.release(sid)
        except Exception:  # noqa: BLE001 - best effort; the service also frees sessions on stream end
            pass

