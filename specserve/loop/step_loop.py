"""A session's step loop: prefill, then propose -> verify -> stream, until a stop. The one loop of every mode (issue
#42): in process on the engine's thread (specserve/loop/engine_thread.py), and over the services' clients.

One sequence S = prompt + emitted tokens; its last token is the pending token (glossary:
specserve/contract/types.py). The drafter keeps its own copy of S; each propose call tells it how
much of its copy is still confirmed (``prefix_len``) and what to append, so a drafter can never
drift from the target. A drafter failure only drops speculation: the loop goes on target-only, which
is still lossless, and the request is marked ``draft_fallback``.

The drafter's session is started lazily, at the first propose: a step that drafts nothing (adaptive
speculation off, or no tokens left) makes no drafter call, so it is exactly a target-only step (the
request's end still releases the drafter's session, started or not). After skipped steps the next propose sends the drafter everything it missed
(tokens and, for a drafter reading target hidden rows, their rows) in one call.

Two optional policies change only *which* tokens are verified, never the acceptance rule:
- adaptive speculation (specserve/loop/adaptive.py) picks each step's chain length, 0 (drafting off) when it
  does not pay, with a probe now and then (and, with draft-ahead, whether drafting ahead pays for its
  contention with the verify);
- draft-ahead: while the target verifies block n, the drafter already drafts block n+1 assuming
  block n is accepted in full (its first token is its guess of the bonus token). When that guess
  holds, the next verify starts at once; otherwise the ahead block is dropped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.contract.types import (
    BadProbs,
    DraftBlock,
    GenerationRequest,
    InvalidBlock,
    TokenLogprobs,
    join_hidden,
)
from specserve.contract.types import check_block as contract_check_block
from specserve.loop.adaptive import AdaptiveSpeculation
from specserve.loop.clients import DraftClient, DraftError, TargetClient
from specserve.loop.detok import IncrementalText
from specserve.loop.stats import SpecStats
from specserve.loop.step_observer import StepObserver, VerifyWalls, drafted_confidence
from specserve.runtime import tracing as names

if TYPE_CHECKING:
    import torch

    from specserve.contract.types import Hidden

EMPTY_BLOCK = DraftBlock(token_ids=())


class MalformedDraft(DraftError):
    """One drafted block is unusable; that step runs target-only and the drafter is kept."""


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    logprobs: TokenLogprobs | None = None  # of token_ids, when the request asked (GenerationRequest.logprobs)
    prompt_logprobs: TokenLogprobs | None = None  # the first event only, when asked


@dataclass(frozen=True)
class FinalEvent:
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats


class UntrustworthyDraft(DraftError):
    """A block whose q is no distribution (rows not summing to 1, q(x) = 0 for a drafted token): the
    drafter is dropped for the rest of the request."""


def check_block(block: DraftBlock, max_nodes: int, vocab_size: int) -> None:
    """Refuse a malformed drafted block (the step then runs target-only) or one whose q could force
    tokens (UntrustworthyDraft: the request goes on target-only). The rules are the target's own."""
    try:
        contract_check_block(block.token_ids, block.probs, vocab_size, max_nodes)
    except BadProbs as exc:
        raise UntrustworthyDraft(str(exc)) from None
    except InvalidBlock as exc:
        raise MalformedDraft(str(exc)) from None


def consecutive_rows(parts: list[Hidden]) -> torch.Tensor | None:  # [sum of rows, F], or None
    """Tensors each starting where the one before ends in one buffer (same storage, strides and width), as one view of
    it (no copy, no device work; complete, runtime/device_stream.py, when every part is); None otherwise. (torch is
    imported here: only an in-process engine's rows are tensors, and the loop's module stays torch-free.)"""
    import torch

    from specserve.runtime.device_stream import COMPLETE, mark_complete

    first = parts[0]
    if not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in parts):
        return None
    storage = first.untyped_storage().data_ptr()
    for prev, p in zip(parts, parts[1:]):
        if (
            p.untyped_storage().data_ptr() != storage
            or p.stride() != first.stride()
            or p.shape[1] != first.shape[1]
            or p.storage_offset() != prev.storage_offset() + prev.shape[0] * prev.stride(0)
        ):
            return None
    rows = sum(p.shape[0] for p in parts)
    view = first.as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())
    return mark_complete(view) if all(getattr(p, COMPLETE, False) for p in parts) else view


def truncate_chain(block: DraftBlock, k: int) -> DraftBlock:
    """The first k drafted tokens of a chain (verifying a prefix is always lossless)."""
    if k >= len(block) or not block.is_chain:
        return block
    probs = None if block.probs is None else block.probs[:k]
    return DraftBlock(token_ids=block.token_ids[:k], probs=probs, confidence=block.confidence[:k])


class _DraftSync:
    """The one place that keeps the drafter in step with S: what it already holds of S (``known``, its
    confirmed prefix), and the target hidden rows it has not been sent yet (tensors, or SharedRows: ranges
    of a target's shared buffer, relayed as they are). Every call that changes the drafter's copy goes
    through here."""

    def __init__(self, needs_hidden: bool) -> None:
        self.known = 0
        self.started = False  # the drafter's session was started (lazily, at the first propose)
        self.needs_hidden = needs_hidden
        self.unsent_hidden: list[Hidden] = []

    def add_hidden(self, rows: Hidden | None) -> None:
        if self.needs_hidden and rows is not None:
            self.unsent_hidden.append(rows)

    def take_hidden(self) -> Hidden | None:
        if not self.needs_hidden or not self.unsent_hidden:
            return None
        # one step's rows (the usual case) go as they are: concatenating device rows here would be GPU work on the
        # event loop; several (steps without a propose in between) are one view where they follow each other in one
        # buffer (an in-process engine's rows: its own row buffer), else joined once
        parts, self.unsent_hidden = self.unsent_hidden, []
        if len(parts) == 1:
            return parts[0]
        joined = consecutive_rows(parts)
        return join_hidden(parts) if joined is None else joined

    async def start(self, draft: DraftClient, sid: str, seq: list[int], sampling) -> None:
        """The drafter's session over S as it is now (prompt + every token emitted so far)."""
        self.started = True
        await draft.start(sid, seq, self.take_hidden(), sampling)
        self.known = len(seq)

    async def propose(self, draft: DraftClient, sid: str, seq: list[int], k: int, tree) -> DraftBlock:
        """The drafter keeps its first ``known`` tokens, gets the rest of S, and drafts."""
        block = await draft.propose(sid, self.known, seq[self.known :], self.take_hidden(), k, tree)
        self.known = len(seq)
        return block

    async def propose_ahead(
        self, draft: DraftClient, sid: str, seq: list[int], block: DraftBlock, k: int
    ) -> DraftBlock:
        """Block n+1 while block n is verified: S + block n as if accepted in full (k + 1 tokens: the first
        is the drafter's guess of the bonus token)."""
        return await draft.propose_ahead(sid, self.known, seq[self.known :] + list(block.token_ids), None, k + 1, None)

    def verified_ahead(self, seq_len: int, accepted: int) -> None:
        """After a verify with a block drafted ahead: the drafter holds S + block (+ its own tail); confirmed
        is S + the accepted prefix."""
        self.known = seq_len + accepted


class _Run:
    """One request's state between steps."""

    def __init__(self, request, target, draft, info, tokenizer, adaptive, sid, on_step) -> None:
        self.request, self.target, self.draft, self.info = request, target, draft, info
        self.adaptive: AdaptiveSpeculation | None = adaptive if request.adaptive else None
        self.sid = sid
        self.stats = SpecStats()
        self.observer = StepObserver(self.stats, self.adaptive, on_step, tree=request.tree is not None)
        self.text = IncrementalText(tokenizer, request.stop)
        self.tracer = names.tracer()
        # per-step spans: whether a tracer provider is installed, asked once a request (the question reads the
        # environment; three times a step it was a tenth of the in-process step's host time, issue #42)
        self.spans = names.tracing_installed()
        self.seq: list[int] = []
        self.emitted: list[int] = []
        self.sync = _DraftSync(needs_hidden=False)
        self.ahead: DraftBlock | None = None  # a block drafted in advance for the current S
        self.in_step = False  # the drafter holds S but the last step's tokens (that step drafted)
        self.step_started = 0.0  # perf_counter at the current step's propose
        self.draft_session = draft  # released at the end even if the request fell back to target-only
        self.cut_confidence = None  # [n] confidence of the drafted tokens this step's verify length cut, or None

    def step_span(self, name: str):
        """The span of one per-step phase (runtime/tracing.step_span); none at all while tracing is off."""
        return names.step_span(self.tracer, name) if self.spans else names.NO_SPAN

    def fallback(self, span, exc: Exception) -> None:
        """Drop the drafter for the rest of the request."""
        self.stats.draft_fallback = True
        self.draft = None
        span.add_event("draft fallback", {"reason": str(exc)[:200]})

    def chain_limit(self) -> int:
        remaining = self.request.max_new_tokens - len(self.emitted)
        return max(
            0, min(self.request.num_speculative_tokens, remaining - 1, self.info.max_context - len(self.seq) - 1)
        )

    def ahead_planned(self, k: int, decide: bool = False) -> bool:
        """Whether a step verifying a chain of k >= 1 tokens drafts the next block meanwhile (adaptive:
        when it pays; ``decide`` is the one call per step that commits, and may probe the other way)."""
        if not self.request.draft_ahead or self.draft is None or self.sync.needs_hidden:
            return False
        if self.adaptive is None:
            return True
        return self.adaptive.plan_ahead(k) if decide else self.adaptive.ahead_pays(k)

    def truncate(self, block: DraftBlock, sunk_ms: float, probe: bool = False) -> DraftBlock:
        """Adaptive: the block is paid for (``sunk_ms``); verify the prefix that pays by each position's confidence
        (specserve/loop/verify_length.py), none of it included: then the step is a target-only step. A probe verifies at
        least one token (it is there to measure). The cut tokens' confidence goes to the step's observations."""
        self.cut_confidence = None
        if self.adaptive is None or not block.is_chain or not len(block):
            return block
        ahead = self.ahead_planned(len(block))
        confidence = drafted_confidence(block)
        k = self.adaptive.choose_k(len(block), confidence, sunk_ms=sunk_ms, ahead=ahead, least=int(probe))
        if confidence is not None and k < len(block):
            self.cut_confidence = confidence[k:]
        return truncate_chain(block, k)

    async def propose(self, span) -> DraftBlock:
        self.step_started = time.perf_counter()
        limit = self.chain_limit()
        if self.draft is None or limit == 0:
            self.ahead = None
            return EMPTY_BLOCK
        if self.ahead is not None:
            block, self.ahead = truncate_chain(self.ahead, limit), None
            return self.truncate(block, sunk_ms=0.0)  # drafted while the last block was verified
        k, probe = limit, False
        if self.adaptive is not None:
            k, probe = self.adaptive.plan(limit, ahead=self.ahead_planned(limit))
            if k == 0:  # a target-only step: the drafter catches up at the next propose
                self.in_step = False
                return EMPTY_BLOCK
        steady, self.in_step = self.in_step, False
        t0 = time.perf_counter()
        try:
            if not self.sync.started:
                with self.tracer.start_as_current_span(names.SPAN_DRAFT_START):
                    await self.sync.start(self.draft, self.sid, self.seq, self.request.sampling)
            with self.step_span(names.SPAN_DRAFT_PROPOSE) as dspan:
                dspan.set_attribute(names.ATTR_K, k)
                block = await self.sync.propose(self.draft, self.sid, self.seq, k, self.request.tree)
            self.in_step = True
            max_nodes = self.request.tree.num_nodes if self.request.tree is not None else k
            check_block(block, max_nodes, self.info.vocab_size)
        except MalformedDraft as exc:
            span.add_event("malformed draft ignored", {"reason": str(exc)[:200]})
            return EMPTY_BLOCK
        except DraftError as exc:
            self.fallback(span, exc)
            return EMPTY_BLOCK
        ms = (time.perf_counter() - t0) * 1e3
        self.observer.drafted(k, ms, steady=steady, probe=probe)
        return self.truncate(block, sunk_ms=ms, probe=probe)

    async def draft_next_ahead(self, block: DraftBlock) -> tuple[DraftBlock, float] | None:
        """Draft block n+1 while block n is verified, assuming block n is accepted in full; with its ms."""
        k = self.request.num_speculative_tokens
        if self.adaptive is not None:
            k = max(1, self.adaptive.choose_k(k, ahead=True))
        t0 = time.perf_counter()
        try:
            ahead = await self.sync.propose_ahead(self.draft, self.sid, self.seq, block, k)
            check_block(ahead, k + 1, self.info.vocab_size)
        except DraftError:
            return None
        ms = (time.perf_counter() - t0) * 1e3
        self.observer.drafted_ahead(ms)
        return ahead, ms

    async def verify(self, span, block: DraftBlock):
        ahead_task = None
        t0 = time.perf_counter()
        if block.is_chain and len(block) and self.ahead_planned(len(block), decide=True):
            ahead_task = asyncio.ensure_future(self.draft_next_ahead(block))
            await asyncio.sleep(0)  # it hands its block to the drafter before the verify (a direct verify never waits)
        try:
            with self.step_span(names.SPAN_TARGET_VERIFY) as vspan:
                sent = block
                if not self.request.trust_draft_probs and block.probs is not None:
                    sent = DraftBlock(token_ids=block.token_ids, parents=block.parents)  # proposal-only
                res = await self.target.verify(self.sid, sent)
                verify_wall_ms = (time.perf_counter() - t0) * 1e3
                if self.spans:
                    self.observer.verify_span(vspan, block, res)
        finally:
            drafted_ahead = await ahead_task if ahead_task is not None else None
        walls = VerifyWalls(
            len(self.seq),
            verify_wall_ms,
            (time.perf_counter() - t0) * 1e3,
            ahead=ahead_task is not None,
            step_started=self.step_started,
            cut_confidence=self.cut_confidence,
        )
        self.cut_confidence = None
        if drafted_ahead is not None:
            ahead, ahead_ms = drafted_ahead
            self.sync.verified_ahead(len(self.seq), len(res.accepted_ids))
            hit = len(res.accepted_ids) == len(block) and ahead.token_ids[:1] == (res.next_token,)
            if hit:  # its first token was the bonus token: the rest is the next block
                probs = None if ahead.probs is None else ahead.probs[1:]
                self.ahead = DraftBlock(token_ids=ahead.token_ids[1:], probs=probs, confidence=ahead.confidence[1:])
            walls = walls._replace(ahead_hit=hit, ahead_ms=ahead_ms)
        self.observer.verified(block, res, walls)
        self.sync.add_hidden(res.hidden)
        return res

    def cut(self, new: list[int]) -> tuple[list[int], str | None, str]:
        """Trim a step's emitted tokens at the first eos (kept), a stop string or the limits."""
        room = self.request.max_new_tokens - len(self.emitted)
        eos = self.info.eos_token_ids
        finish = None
        for i, t in enumerate(new[:room]):
            if t in eos:
                new, finish = new[: i + 1], "eos"
                break
        else:
            if len(new) >= room:
                new, finish = new[:room], "length"
        delta, stopped = self.text.push(new)
        self.emitted.extend(new)
        self.stats.completion_tokens = len(self.emitted)
        if stopped:
            finish = "stop"
        elif finish is None and len(self.seq) >= self.info.max_context:
            finish = "length"
        return new, finish, delta


async def run_request(
    request: GenerationRequest,
    target: TargetClient,
    draft: DraftClient | None,
    *,
    tokenizer=None,
    target_info=None,
    adaptive: AdaptiveSpeculation | None = None,
    session_id: str | None = None,
    on_step=None,
    started: float | None = None,
    request_span: str = names.SPAN_REQUEST,
) -> AsyncIterator[TokenEvent | FinalEvent]:
    """Yield token deltas as they are accepted, then one FinalEvent. Releases both sessions at the end.

    ``adaptive`` is the process-wide chooser (its cost model outlives requests); it is used only when
    ``request.adaptive`` is set. ``on_step(StepRecord)`` is called after every verify step. ``started``: the
    request's arrival on the ``time.perf_counter`` clock (TTFT counts from there; default: now). ``request_span``: the
    name of the request's span (the target's own loop: ``target.run``, under the gateway's request span).
    """
    sid = session_id or uuid.uuid4().hex
    info = target_info or await target.info()
    if request.adaptive and adaptive is None:
        raise ValueError("adaptive speculation was asked for but no AdaptiveSpeculation was given")
    run = _Run(request, target, draft, info, tokenizer, adaptive, sid, on_step)
    if started is not None:
        run.stats.started = started
    tracer = run.tracer
    with tracer.start_as_current_span(request_span) as span:
        span.set_attribute(names.ATTR_MODEL, request.model_name or info.model_type)
        span.set_attribute(names.ATTR_INPUT_TOKENS, len(request.prompt_ids))
        span.set_attribute(names.ATTR_SESSION, sid)
        hidden_layers: tuple[int, ...] = ()
        if run.draft is not None:
            try:
                draft_info = await run.draft.info()
                span.set_attribute(names.ATTR_DRAFT_FAMILY, draft_info.family)
                if draft_info.needs_hidden_states:
                    hidden_layers = tuple(draft_info.hidden_layers)
            except DraftError as exc:
                run.fallback(span, exc)
        run.sync = _DraftSync(needs_hidden=bool(hidden_layers))
        try:
            with tracer.start_as_current_span(names.SPAN_PREFILL):
                pre = await target.prefill(
                    sid, request.prompt_ids, request.sampling, hidden_layers, logprobs=request.logprobs
                )
            run.seq = list(request.prompt_ids) + [pre.next_token]
            run.sync.add_hidden(pre.hidden)
            run.stats.first_token()
            new, new_lp, prompt_lp = [pre.next_token], pre.logprobs, pre.prompt_logprobs
            while True:
                with run.step_span(names.SPAN_ACCEPT_STREAM):
                    new, finish, delta = run.cut(new)
                if new:
                    lp = None if new_lp is None else new_lp.head(len(new))
                    yield TokenEvent(tuple(new), delta, lp, prompt_lp)
                    prompt_lp = None
                if finish is not None:
                    break
                block = await run.propose(span)
                res = await run.verify(span, block)
                new, new_lp = list(res.emitted), res.logprobs
                run.seq.extend(new)
            stats = run.stats
            end_request_span(span, stats, len(run.emitted), finish)
            final_text = run.text.text if tokenizer is not None else None
            yield FinalEvent(tuple(run.emitted), final_text, finish, len(request.prompt_ids), len(run.emitted), stats)
        finally:
            await _release(sid, target, run.draft_session)


def end_request_span(span, stats: SpecStats, output_tokens: int, finish: str) -> None:
    """A request span's closing attributes (the loop's, and the gateway's when the target ran the loop)."""
    span.set_attribute(names.ATTR_OUTPUT_TOKENS, output_tokens)
    span.set_attribute(names.ATTR_FINISH_REASON, finish)
    span.set_attribute(names.ATTR_MEAN_ACCEPTED_LENGTH, stats.mean_accepted_length)
    span.set_attribute(names.ATTR_TTFT_S, (stats.first_token_at or stats.started) - stats.started)
    span.set_attribute(names.ATTR_DRAFT_FALLBACK, stats.draft_fallback)


async def _release(sid: str, target: TargetClient, draft: DraftClient | None) -> None:
    """Free both sessions in a task of their own, shielded: the request may end by cancellation
    (a client that hangs up; CancelledError and GeneratorExit are not Exceptions), and a second
    cancellation while releasing must not skip the target's release either. A failure to release
    must not mask the request's own outcome; the services also expire idle sessions."""

    async def both() -> None:
        for part in (draft, target):
            if part is None:
                continue
            try:
                await part.release(sid)
            except Exception:  # noqa: BLE001 - best effort
                pass

    await asyncio.shield(asyncio.ensure_future(both()))  # cancelled: the release task goes on
