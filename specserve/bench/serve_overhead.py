"""Per-step orchestration overhead: one process, the shared-memory data plane and gRPC only, in one run.

    specserve bench overhead [--model DIR | synthetic:NAME[:LAYERS]] [--drafters none,ngram]
        [--vias process,process-hops,gateway-shm,serve-shm,serve-grpc] [--k 4] [--requests 3] [--max-new-tokens 64]
        [--rounds 2] [--deadline-s 120] [--out DIR]

Each method (target-only; each drafter at chain length ``--k``, greedy) runs the one step loop
(specserve/loop/step_loop.py) five ways, interleaved round by round: in process on the engine's thread, direct calls
(``process``: what `generate` and `bench` run, specserve/loop/engine_thread.py), in process over the threaded adapters
(``process-hops``: the loop on the caller's event loop, each verify and propose a round trip to the part's thread,
as before issue #42), in a `specserve target` process that runs the loop itself (its Run call, as the gateway hands
it a request: target_service/loop_serving.py; what `serve` runs) proposing to a `specserve draft` process over the
draft's shared-memory ring (``serve-shm``) or gRPC (``serve-grpc``), and the gateway's own loop over the remote
adapters with the shared-memory data plane to both services (``gateway-shm``: the served path before the target ran
the loop, still the one of a request with stop strings); ``--vias`` picks some of them (``process`` always: the others
are compared with it), and without a served via no service process starts.
Per step:

    overhead = step wall - engine compute - proposer compute

where the step wall is the time from one verify step's end to the next (as `specserve bench` counts
it; for the target's loop, from one step's event to the next as they reach this process, the gateway's place), engine compute is the engine's own verify call as it measures it on its thread
(``StepTimings.compute_ms``), and proposer compute is the drafter's own propose call (the draft
service reports it in the same field; in process it is timed around the proposer). What is left is
orchestration: the loop, thread hops, protobuf and tensor conversion, transport, the event loops'
wake-ups. Because the model's time is subtracted, the model may be anything the engine runs; the
default (the shipped demo on the CPU) has a real engine and vocabulary, so the n-gram drafter runs
beside it. ``transport`` is the part outside both services (call wall minus the service's own
handling, ``StepTimings.total_ms``). Served requests carry a deadline (``--deadline-s``), as a
client's usually do: every wait then has a timeout, as in production.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

VIAS = ("process", "process-hops", "gateway-shm", "serve-shm", "serve-grpc")
IN_PROCESS = ("process", "process-hops")
TARGET_LOOP = ("serve-shm", "serve-grpc")  # the target runs the loop (Run); gateway-shm: this process does
DRAFTERS = ("none", "ngram")  # drafters without a checkpoint of their own


@dataclass(frozen=True)
class OverheadConfig:
    model: str  # checkpoint folder or synthetic:NAME[:LAYERS]
    device: str = "cpu"
    dtype: str = "float32"
    drafters: tuple[str, ...] = ("none", "ngram")
    vias: tuple[str, ...] = VIAS  # in VIAS' order; "process" among them
    k: int = 4
    requests: int = 3
    max_new_tokens: int = 64
    rounds: int = 2
    prompt_len: int = 24
    seed: int = 0
    deadline_s: float = 120.0  # each served request's deadline (a client's; the draft's step timeout applies anyway)
    num_kv_blocks: int = 256
    kv_block_size: int = 16
    invariant_steps: bool | None = None  # the target's token-count invariant steps (EngineConfig.invariant_steps)

    def __post_init__(self) -> None:
        unknown = [d for d in self.drafters if d not in DRAFTERS]
        if unknown or not self.drafters:
            raise ValueError(f"--drafters: choose from {', '.join(DRAFTERS)}, got {','.join(self.drafters)}")
        if "process" not in self.vias or any(v not in VIAS for v in self.vias):
            raise ValueError(f"--vias: choose from {', '.join(VIAS)}, process among them, got {','.join(self.vias)}")
        if str(self.model).startswith("synthetic:") and "ngram" in self.drafters:
            raise ValueError("--drafters ngram needs a checkpoint folder as --model (its vocabulary)")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        for name in ("k", "requests", "max_new_tokens", "rounds", "prompt_len", "num_kv_blocks", "kv_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def served(self) -> bool:
        """Whether a via runs through the service processes."""
        return any(v not in IN_PROCESS for v in self.vias)

    @property
    def drafter_block_size(self) -> int:  # what the served stack gives `specserve draft --max-block-size`
        from specserve.contract.speculation import block_size_for

        return block_size_for(self.k)


class _TimedProposer:
    """The in-process proposer, with its own propose time summed (what the draft service reports)."""

    def __init__(self, proposer) -> None:
        self._proposer = proposer
        self.info = proposer.info
        self.compute_ms = 0.0

    def start(self, *args):
        return self._proposer.start(*args)

    def propose(self, *args):
        t0 = time.perf_counter()
        try:
            return self._proposer.propose(*args)
        finally:
            self.compute_ms += (time.perf_counter() - t0) * 1e3

    def release(self, *args):
        return self._proposer.release(*args)


def _prompts(config: OverheadConfig, vocab_size: int) -> list[tuple[int, ...]]:
    """Fixed prompts of a few repeated phrases (the n-gram drafter finds something to draft)."""
    import random

    rng = random.Random(config.seed)
    out = []
    for _ in range(config.requests):
        phrase = [rng.randrange(3, vocab_size) for _ in range(6)]
        out.append(tuple((phrase * (config.prompt_len // len(phrase) + 1))[: config.prompt_len]))
    return out


class _Clients:
    """Per via, the target client and the drafter clients of one request."""

    def __init__(self, config: OverheadConfig, stack) -> None:
        from specserve.draft_service.drafter_config import DrafterConfig
        from specserve.draft_service.registry import build_proposer
        from specserve.loop.engine_thread import EngineThread
        from specserve.loop.local import LocalDraft, LocalTarget
        from specserve.target_service.factory import EngineConfig, build_engine

        self.stack = stack
        self.deadline_s = config.deadline_s
        engine = build_engine(
            EngineConfig(
                model=config.model,
                device=config.device,
                dtype=config.dtype,
                num_kv_blocks=config.num_kv_blocks,
                kv_block_size=config.kv_block_size,
                invariant_steps=config.invariant_steps,
            )
        )
        self.info = engine.info()
        self.engine_thread = EngineThread(engine)
        self.local_target = LocalTarget(engine)
        self.proposers: dict[str, _TimedProposer] = {}
        self.local_drafts: dict[str, LocalDraft] = {}
        for family in config.drafters:
            if family == "none":
                continue
            proposer = _TimedProposer(
                build_proposer(
                    DrafterConfig(
                        family=family,
                        target_checkpoint=Path(config.model),
                        device=config.device,
                        dtype=config.dtype,
                        max_block_size=config.drafter_block_size,
                    )
                )
            )
            self.proposers[family] = proposer
            self.local_drafts[family] = LocalDraft(proposer)

    def session(self, via: str, drafter: str):
        """(target client, draft client or None, a reading of the draft's summed compute ms)."""
        if via in IN_PROCESS:
            draft = self.local_drafts.get(drafter)
            proposer = self.proposers.get(drafter)
            return self.local_target, draft, (lambda: proposer.compute_ms) if proposer else (lambda: 0.0)
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        target = self.stack.targets["serve-shm"].session(deadline)  # gateway-shm: the adapters of the shm via
        draft = None if drafter == "none" else self.stack.drafts["serve-shm"][drafter].session(deadline)
        return target, draft, (lambda: draft.compute_ms) if draft is not None else (lambda: 0.0)

    def run_on_target(self, via: str, drafter: str, request, tag: str, on_step):
        """The request's loop on the target (Run), its events as the loop's; ``on_step(StepRecord, RunTokens)``."""
        from specserve.protos import convert

        address = "" if drafter == "none" else self.stack.draft_addresses[drafter]
        reserve = len(request.prompt_ids) + request.max_new_tokens + request.num_speculative_tokens + 1
        shm = via == "serve-shm"
        msg = convert.run_request_to_proto(request, tag, address, self.deadline_s, reserve, shm=shm, hidden_share=shm)
        deadline = asyncio.get_running_loop().time() + self.deadline_s
        return self.stack.targets["serve-shm"].run(msg, deadline, on_step=on_step)

    def close(self) -> None:
        self.engine_thread.close()
        self.local_target.close()
        for d in self.local_drafts.values():
            d.close()


async def _one_request(clients: _Clients, via: str, drafter: str, k: int, prompt, max_new_tokens: int, tag: str):
    from specserve.contract.types import GenerationRequest, SamplingParams
    from specserve.loop.step_loop import FinalEvent, run_request

    request = GenerationRequest(
        prompt_ids=prompt,
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(),
        num_speculative_tokens=0 if drafter == "none" else k,
        adaptive=False,
        draft_ahead=False,
    )
    target, draft, draft_compute = clients.session(via, drafter)
    rows: list[dict] = []
    mark = [0.0]
    seen = [draft_compute()]

    def on_event(event) -> None:  # where the events are made (the engine's thread for ``process``)
        if not mark[0]:
            mark[0] = time.perf_counter()  # the first step's wall starts at the first token

    def on_step(rec) -> None:
        now = time.perf_counter()
        total = draft_compute()
        draft_ms, seen[0] = total - seen[0], total
        draft_wall = rec.draft_ms
        draft_service = getattr(draft, "service_ms", 0.0)  # summed; only its per-step delta is used below
        rows.append(
            {
                "wall_ms": (now - mark[0]) * 1e3,
                "engine_ms": rec.verify_compute_ms,
                "draft_ms": draft_ms,
                "verify_wall_ms": rec.verify_wall_ms,
                "verify_service_ms": rec.verify_service_ms,
                "draft_wall_ms": draft_wall,
                "draft_service_total": draft_service,
                "drafted": rec.drafted,
                "accepted": rec.accepted,
            }
        )
        mark[0] = now

    service_total = [0.0]

    def on_target_step(rec, tok) -> None:  # the target's loop: its compute and the draft's come with the event
        service_total[0] += tok.draft_service_ms
        on_step(rec)
        rows[-1].update(
            engine_ms=tok.verify_compute_ms,
            draft_ms=tok.draft_compute_ms,
            verify_service_ms=0.0,  # no hop to the target: the loop runs there
            draft_service_total=service_total[0],
        )

    tokens: tuple[int, ...] = ()
    kwargs = dict(target_info=clients.info, session_id=tag, on_step=on_step)
    if via == "process":
        events = clients.engine_thread.generate(request, draft, on_event=on_event, tokens=False, **kwargs)
    elif via in TARGET_LOOP:
        request = dataclasses.replace(request, draft_name=drafter if draft is not None else None)
        events = clients.run_on_target(via, drafter, request, tag, on_target_step)
    else:
        events = run_request(request, target, draft, **kwargs)
    async for event in events:
        if via != "process":
            on_event(event)
        if isinstance(event, FinalEvent):
            tokens = event.token_ids
    prev = 0.0
    for r in rows:  # the draft service's handling per step (its total is summed over the session)
        total = r.pop("draft_service_total")
        r["draft_service_ms"], prev = total - prev, total
    return rows, tokens


def _us(values: list[float]) -> dict:
    if not values:
        return {"median": 0.0, "mean": 0.0, "p90": 0.0}
    s = sorted(values)
    return {
        "median": round(statistics.median(s) * 1e3, 1),
        "mean": round(statistics.fmean(s) * 1e3, 1),
        "p90": round(s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3, 1),
    }


def summarize(rows: list[dict], via: str) -> dict:
    """Per-step numbers of one method and via (us): wall, engine and proposer compute, overhead, transport."""
    overhead = [r["wall_ms"] - r["engine_ms"] - r["draft_ms"] for r in rows]
    transport = []
    for r in rows:
        t = 0.0
        if via not in IN_PROCESS:
            t += max(0.0, r["verify_wall_ms"] - r["verify_service_ms"]) if r["verify_service_ms"] > 0 else 0.0
            t += max(0.0, r["draft_wall_ms"] - r["draft_service_ms"]) if r["draft_wall_ms"] > 0 else 0.0
        transport.append(t)
    return {
        "steps": len(rows),
        "wall_us": _us([r["wall_ms"] for r in rows]),
        "engine_compute_us": _us([r["engine_ms"] for r in rows]),
        "draft_compute_us": _us([r["draft_ms"] for r in rows]),
        "overhead_us": _us(overhead),
        "transport_us": _us(transport),
        "mean_accepted": round(statistics.fmean(r["accepted"] for r in rows), 3) if rows else 0.0,
    }


async def _run_all(config: OverheadConfig, clients: _Clients) -> dict:
    vias = tuple(v for v in VIAS if v in config.vias)
    if clients.stack is not None:
        await clients.stack.connect()
    try:
        prompts = _prompts(config, clients.info.vocab_size)
        rows: dict[tuple[str, str], list[dict]] = {}
        tokens: dict[tuple[str, str], list] = {}
        wall: dict[tuple[str, str], float] = {}
        n = 0
        for drafter in config.drafters:  # warm-up: one request each way (graphs, allocator, channels)
            for via in vias:
                n += 1
                await _one_request(clients, via, drafter, config.k, prompts[0], 8, f"warmup-{n}")
        for _ in range(config.rounds):
            for drafter in config.drafters:
                for via in vias:
                    key = (drafter, via)
                    t0 = time.perf_counter()
                    for prompt in prompts:
                        n += 1
                        r, toks = await _one_request(
                            clients, via, drafter, config.k, prompt, config.max_new_tokens, f"ovh-{n}"
                        )
                        rows.setdefault(key, []).extend(r)
                        tokens.setdefault(key, []).append(toks)
                    wall[key] = wall.get(key, 0.0) + time.perf_counter() - t0
    finally:
        if clients.stack is not None:
            await clients.stack.disconnect()
    out: dict = {}
    for drafter in config.drafters:
        method = "target-only" if drafter == "none" else f"{drafter}/k{config.k}"
        reference = tokens[("none", "process")] if "none" in config.drafters else tokens[(drafter, "process")]
        out[method] = {}
        for via in vias:
            key = (drafter, via)
            s = summarize(rows[key], via)
            s["tokens_per_s"] = round(sum(len(t) for t in tokens[key]) / wall[key], 1)
            s["same_tokens"] = tokens[key] == reference
            out[method][via] = s
        base = out[method]["process"]["overhead_us"]["median"]
        for via in vias[1:]:
            out[method][via]["overhead_vs_process_us"] = round(out[method][via]["overhead_us"]["median"] - base, 1)
    return out


def run(config: OverheadConfig) -> dict:
    from specserve.bench.served import ServedStack
    from specserve.runtime.servers_common import run_async

    families = [d for d in config.drafters if d != "none"]
    stack = ServedStack(config, {}, families, start_timeout_s=300.0) if config.served else None
    clients = None
    try:
        clients = _Clients(config, stack)
        result: dict = {}

        async def main() -> None:
            result["methods"] = await _run_all(config, clients)

        run_async(main())
        if stack is not None:
            result["services"] = stack.service_stats()
    finally:
        if clients is not None:
            clients.close()
        if stack is not None:
            stack.close()
    return result


def table(result: dict) -> str:
    lines = [
        "| method | via | tok/s | step wall us | engine us | proposer us | overhead us (median / mean / p90) "
        "| vs process us | of which transport us | same tokens |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for method, vias in result["methods"].items():
        for via, s in vias.items():
            o = s["overhead_us"]
            lines.append(
                f"| {method} | {via} | {s['tokens_per_s']} | {s['wall_us']['median']} | "
                f"{s['engine_compute_us']['median']} | {s['draft_compute_us']['median']} | "
                f"{o['median']} / {o['mean']} / {o['p90']} | {s.get('overhead_vs_process_us', '-')} | "
                f"{s['transport_us']['median']} | {'yes' if s['same_tokens'] else 'NO'} |"
            )
    return "\n".join(lines)
