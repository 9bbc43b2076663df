"""Run our stack (engine + drafter + the per-request loop) one request at a time and record each step.

Per step: the loop's StepRecord (draft ms, verify ms as the target measured it, experts touched,
context length) plus the step's wall time as seen here (from the previous step, or from the first
token for step 1), overhead = wall - draft - verify, and the byte floor of the step.

``via``: "process" runs engine and drafters in this process (the loop on the engine's thread); "serve-shm" and
"serve-grpc" hand each request to the `specserve target` process of a ``ServedStack`` (specserve/bench/served.py),
whose own loop runs it (Run, as the gateway does) with the draft service over its ring or gRPC; a step's draft time is
the one the draft service measured (so transport is overhead, not draft), its wall is from one step's event to the
next as they reach this process (the gateway's place).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.bench.config import BenchConfig, MethodSpec
from specserve.bench.floors import ModelBytes, floor_ms, step_bytes


@dataclass
class RequestResult:
    method: str
    prompt_id: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    finish_reason: str
    ttft_s: float  # request start -> first token (prefill)
    decode_s: float  # first token -> last token
    stats: dict  # SpecStats.as_dict() plus draft-ahead time
    steps: list[dict] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class SpecRunner:
    """Holds the engine (on its own thread, where the in-process step loop runs, as in `generate`), the drafters and
    one event loop."""

    def __init__(
        self, engine, proposers: dict, config: BenchConfig, model_bytes: ModelBytes, bandwidth: float, served=None
    ) -> None:
        from specserve.loop.engine_thread import EngineThread, new_loop
        from specserve.loop.local import LocalDraft

        self.config = config
        self.engine = engine
        self.info = engine.info()
        self.target = EngineThread(engine)  # in process the step loop runs on the engine's thread
        self.drafts = {family: LocalDraft(p) for family, p in proposers.items()}
        self.model_bytes = model_bytes
        self.bandwidth = bandwidth
        self.loop = new_loop()
        self._counter = 0
        self.served = served  # a ServedStack (or None: in-process only)
        if served is not None:
            self.loop.run_until_complete(served.connect())

    def close(self) -> None:
        if self.served is not None:
            self.loop.run_until_complete(self.served.disconnect())
        self.target.close()
        for d in self.drafts.values():
            d.close()
        self.loop.close()

    def new_chooser(self, spec: MethodSpec):
        """The process-wide adaptive chooser of one method (kept across its warm-up and prompts)."""
        if not spec.adaptive:
            return None
        from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation

        return AdaptiveSpeculation(AdaptiveConfig(max_k=spec.k))

    def run(
        self,
        spec: MethodSpec,
        prompt_id: str,
        prompt_ids: Sequence[int],
        chooser,
        max_new_tokens: int | None = None,
        via: str = "process",
    ) -> RequestResult:
        return self.loop.run_until_complete(self._run(spec, prompt_id, tuple(prompt_ids), chooser, max_new_tokens, via))

    def _clients(self, spec: MethodSpec, via: str):
        """(target client, draft client or None) of one request in process; served: (None, None)."""
        if via == "process":
            return self.target, None if spec.drafter == "none" else self.drafts[spec.drafter]
        return None, None

    def _run_on_target(self, spec: MethodSpec, request, session_id: str, via: str, on_step):
        """A served request: the target's loop (Run) with the draft service of the method's drafter, over its ring
        (``serve-shm``) or gRPC (``serve-grpc``); its events as the loop's."""
        import dataclasses

        from specserve.protos import convert

        address = "" if spec.drafter == "none" else self.served.draft_addresses[spec.drafter]
        request = dataclasses.replace(request, draft_name=spec.drafter if address else None)
        reserve = len(request.prompt_ids) + request.max_new_tokens + request.num_speculative_tokens + 1
        shm = via == "serve-shm"
        msg = convert.run_request_to_proto(request, session_id, address, 60.0, reserve, shm=shm, hidden_share=shm)
        return self.served.targets[via].run(msg, None, on_step=on_step)

    async def _run(
        self,
        spec: MethodSpec,
        prompt_id: str,
        prompt_ids: tuple[int, ...],
        chooser,
        max_new_tokens,
        via: str = "process",
    ) -> RequestResult:
        from specserve.contract.types import SamplingParams
        from specserve.loop.step_loop import (
            FinalEvent,
            GenerationRequest,
        )

        cfg = self.config
        request = GenerationRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens or cfg.max_new_tokens,
            sampling=SamplingParams(temperature=0.0, seed=cfg.seed),
            num_speculative_tokens=spec.k,  # fixed: every step's k; adaptive: its cap
            adaptive=spec.adaptive,
            draft_ahead=spec.draft_ahead,
        )
        target, draft = self._clients(spec, via)
        self._counter += 1
        steps: list[dict] = []
        mark = [0.0]
        served_ms = [0.0]  # the draft service's own draft time so far (served vias)

        def on_step(rec) -> None:
            now = time.perf_counter()
            draft_ms = None
            if via != "process" and draft is not None:
                draft_ms, served_ms[0] = draft.service_ms - served_ms[0], draft.service_ms
                draft_ms = draft_ms if rec.draft_ms > 0 else 0.0  # drafted ahead: hidden, as in-process
            steps.append(self._step_row(spec, prompt_id, rec, (now - mark[0]) * 1e3, via, draft_ms))
            mark[0] = now

        t0 = time.perf_counter()
        first: list[float] = []  # when the first event was made (a step's wall counts from the event before it)
        final = None

        def on_event(event) -> None:  # where the events are made: the engine's thread in process
            if not first:
                first.append(time.perf_counter())
                mark[0] = first[0]

        def on_run_step(rec, tok) -> None:  # the target's loop: the draft service's time comes with the step
            now = time.perf_counter()
            draft_ms = tok.draft_service_ms if rec.draft_ms > 0 else 0.0  # drafted ahead: hidden, as in-process
            steps.append(self._step_row(spec, prompt_id, rec, (now - mark[0]) * 1e3, via, draft_ms))
            mark[0] = now

        kwargs = dict(target_info=self.info, adaptive=chooser, session_id=f"bench-{self._counter}", on_step=on_step)
        if via == "process":
            events = self.target.generate(request, draft, on_event=on_event, tokens=False, **kwargs)
        else:  # the target runs the loop (Run), as the gateway hands it a request: its own chooser per draft address
            events = self._run_on_target(spec, request, kwargs["session_id"], via, on_run_step)
        async for event in events:
            if via != "process":
                on_event(event)
            if isinstance(event, FinalEvent):
                final = event
        t_end = time.perf_counter()
        t_first = first[0] if first else None
        if final is None:
            raise RuntimeError(f"{spec.name} on {prompt_id}: the request ended without a final event")
        stats = final.stats.as_dict()
        stats["draft_ahead_ms"] = round(final.stats.draft_ahead_ms, 3)
        stats["verify_ms"] = round(final.stats.verify_ms, 3)
        return RequestResult(
            method=spec.name if via == "process" else f"{spec.name}@{via}",
            prompt_id=prompt_id,
            prompt_tokens=len(prompt_ids),
            token_ids=final.token_ids,
            finish_reason=final.finish_reason,
            ttft_s=(t_first or t_end) - t0,
            decode_s=t_end - (t_first or t_end),
            stats=stats,
            steps=steps,
        )

    @staticmethod
    def _transport_ms(via: str, rec, draft_service_ms: float) -> float:
        if via == "process":
            return 0.0
        verify = max(0.0, rec.verify_wall_ms - rec.verify_service_ms) if rec.verify_service_ms > 0 else 0.0
        draft = max(0.0, rec.draft_ms - draft_service_ms) if rec.draft_ms > 0 else 0.0
        return verify + draft

    def _step_row(
        self, spec: MethodSpec, prompt_id: str, rec, wall_ms: float, via: str = "process", draft_ms: float | None = None
    ) -> dict:
        verify_ms = rec.verify_ms if rec.verify_ms > 0 else rec.verify_wall_ms
        draft_ms = rec.draft_ms if draft_ms is None else draft_ms
        nbytes = step_bytes(self.model_bytes, rec.drafted + 1, rec.experts_touched, rec.context_len)
        floor = floor_ms(nbytes.total, self.bandwidth)
        return {
            "method": spec.name if via == "process" else f"{spec.name}@{via}",
            "via": via,
            "drafter": spec.drafter,
            "speculation": spec.speculation,
            "draft_ahead": spec.draft_ahead,
            "k": spec.k,
            "prompt": prompt_id,
            "step": rec.step,
            "context_len": rec.context_len,
            "drafted": rec.drafted,
            "accepted": rec.accepted,
            "draft_ms": round(draft_ms, 4),
            "draft_wall_ms": round(rec.draft_ms, 4),
            "verify_ms": round(verify_ms, 4),
            "verify_ms_source": "target" if rec.verify_ms > 0 else "loop_wall",
            "verify_wall_ms": round(rec.verify_wall_ms, 4),
            "wall_ms": round(wall_ms, 4),
            "overhead_ms": round(wall_ms - draft_ms - verify_ms, 4),
            # served: the time outside both services (wire, encoding, the loops' wakes); in process: 0
            "transport_ms": round(self._transport_ms(via, rec, draft_ms), 4),
            "experts_touched": rec.experts_touched,
            "floor_bytes": nbytes.total,
            "floor_ms": round(floor, 5),
            "tree": rec.tree,
            "ahead": rec.ahead,
            "ahead_ms": round(rec.ahead_ms, 4),  # the block drafted ahead: drafter wall time,
            "ahead_wait_ms": round(rec.ahead_wait_ms, 4),  # the part after the verify came back (not overlapped)
            "ahead_hit": rec.ahead_hit,
        }
