"""TargetEngine: sessions over a paged KV cache; prefill, verify (chain or tree, batched), rollback.

Terms follow the glossary in ``specserve/contract/types.py``. Between steps a session holds ``cached_len`` tokens
of K/V and one pending token. A verify step feeds ``[pending] + drafted`` in one forward (chain:
causal; tree: ancestor mask, positions ``cached_len + depth``), writes their K/V to the step-local slots
``cached_len + node``, accepts with the rules of ``engine/sampler.py``, moves the accepted tree path to
contiguous slots (``PagedKVCache.copy_slots``) and truncates the sequence to
``cached_len + 1 + accepted``: the rejected tokens' slots are beyond the length and never read again.

The engine is synchronous and not thread-safe: drive it from one thread. Every public method checks
its input before it changes any state, so a refused call leaves the engine as it was.

A batched verify's bookkeeping (each session's share of the forward, its timer) is ``engine/batch.py``;
the log-probabilities a session asks for, ``engine/logprobs.py``; the hidden rows a session reads (the engine's own
row buffer, a drafter's layers among those captured), ``engine/hidden_rows.py``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence

import torch

from specserve.contract.types import (
    DraftBlock,
    InvalidBlock,
    LogprobsSpec,
    PrefillResult,
    SamplingParams,
    StepTimings,
    VerifyResult,
    check_block,
)
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.block_manager import BlockManager, KVUsage, OutOfBlocks
from specserve.models.kv_cache import PagedKVCache
from specserve.models.probs import make_generator, new_seed_key, target_probs
from specserve.models.vocab import vocab_hash as checkpoint_vocab_hash
from specserve.runtime.device_stream import mark_complete

from .batch import BatchStep, StepTimer
from .hidden_rows import LayerColumns, grow_rows, new_rows
from .logprobs import prompt_logprobs, token_logprobs
from .model_runner import GraphOptions, ModelRunner, RunOutput, distinct_experts
from .sampler import verify_step_device
from .session import (
    ContextTooLong,
    DuplicateSession,
    EngineInfo,
    InvalidInput,
    Session,
    SessionView,
    UnknownSession,
)
from .tree import StepLayout, compaction_moves, layout_of

__all__ = [
    "ContextTooLong",
    "DuplicateSession",
    "EngineInfo",
    "InvalidInput",
    "OutOfBlocks",
    "TargetEngine",
    "UnknownSession",
]

_EMPTY = DraftBlock(token_ids=())


def tokenizer_vocab_hash(tokenizer, vocab_size: int) -> str:
    """The models/vocab.py fingerprint, computed from a loaded ``tokenizers.Tokenizer`` (or None)."""
    if tokenizer is None:
        return f"size:{vocab_size}"
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer.to_str())
        return checkpoint_vocab_hash(tmp)


class TargetEngine:
    def __init__(
        self,
        model,  # CausalLM
        config,  # ModelConfig
        tokenizer=None,  # tokenizers.Tokenizer or None
        *,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device | None = None,
        hidden_layers: tuple[int, ...] = (),  # default capture layers when prefill passes None
        max_context: int | None = None,  # cap below the model's max_position_embeddings
        vocab_hash: str | None = None,  # override the fingerprint computed from the tokenizer
        cuda_graphs: GraphOptions | None = None,  # capture these verify/decode steps now (FlashInfer backend)
        seed_key: bytes | None = None,  # seeded sampling's secret (models/probs.py); None: one of this engine's own
        invariant_rows: int = 0,  # > 0: token-count invariant steps padded to this many rows (model_runner.py)
    ) -> None:
        self.model = model
        self._seed_key = seed_key or new_seed_key()
        self.config = config
        self.tokenizer = tokenizer
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype  # of the model, its cache and its hidden rows
        self.max_context = int(min(config.max_position_embeddings, max_context or config.max_position_embeddings))
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        self.default_hidden_layers = self._check_layers(tuple(hidden_layers))
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv_cache = PagedKVCache(
            config.num_layers, num_blocks, block_size, model.kv_entry_shape(), param.dtype, self.device
        )
        self._sessions: dict[str, Session] = {}
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            block_size=block_size,
            max_context=self.max_context,
            device=self.device,
            invariant_rows=invariant_rows,
        )
        self._graph_options = cuda_graphs
        if cuda_graphs is not None:
            self.runner.capture(cuda_graphs)  # before any session: capture writes scratch K/V
        moe = getattr(config, "moe", None)
        self._num_experts = int(moe.num_experts) if moe is not None else 0
        on_cuda = self.device.type == "cuda"
        self._summary_host = torch.zeros(3, dtype=torch.int64, pin_memory=on_cuda)  # a graph step's one read
        self._summary_read = torch.cuda.Event() if on_cuda else None
        self._columns = LayerColumns(config.hidden_size)  # a drafter's layers among a step's captured ones
        self._info = EngineInfo(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            vocab_hash=vocab_hash or tokenizer_vocab_hash(tokenizer, config.vocab_size),
            max_context=self.max_context,
            num_layers=config.num_layers,
            hidden_size=config.hidden_size,
            eos_token_ids=tuple(config.eos_token_ids),
            kv_block_size=block_size,
            kv_num_blocks=num_blocks,
        )

    def add_graph_layers(self, layers: Sequence[int]) -> None:
        """Also capture this engine's CUDA graphs returning these hidden layers, so the steps of drafters that read
        them (EAGLE-3, DFlash) replay graphs too. No-op without graphs; only before any session opens."""
        if not layers:
            return
        wanted = self._check_layers(tuple(sorted(set(int(i) for i in layers))))  # checked with or without graphs
        if self._graph_options is None:
            return
        if self._sessions:
            raise InvalidInput("graphs are captured before any session opens")
        self.runner.capture(dataclasses.replace(self._graph_options, capture_layers=wanted))

    # ---- queries ---------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return self._info

    def kv_usage(self) -> KVUsage:
        return self.blocks.usage()

    def has_session(self, session_id: str) -> bool:
        return session_id in self._sessions

    def session(self, session_id: str) -> SessionView:
        s = self._get(session_id)
        return SessionView(s.session_id, s.cached_len, s.pending_token, s.steps, s.hidden_layers, s.sampling)

    def _get(self, session_id: str) -> Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSession(session_id) from None

    # ---- input checks ----------------------------------------------------------------------------
    def _check_layers(self, layers: tuple[int, ...]) -> tuple[int, ...]:
        bad = [i for i in layers if not 0 <= int(i) < self.config.num_layers]
        if bad:
            raise InvalidInput(f"hidden_layers {bad[:4]} outside [0, {self.config.num_layers}) ({len(bad)} in all)")
        if len(set(layers)) != len(layers):
            raise InvalidInput(f"hidden_layers {layers[:8]} repeat a layer")
        return tuple(int(i) for i in layers)

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        v = self.config.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < v]
        if bad:
            raise InvalidInput(f"{what}: token ids {bad[:4]} outside the vocabulary [0, {v})")

    def _check_block(self, session: Session, block: DraftBlock) -> None:
        if not isinstance(block, DraftBlock):
            raise InvalidInput(f"expected a DraftBlock, got {type(block).__name__}")
        try:
            check_block(block.token_ids, None, self.config.vocab_size)
        except InvalidBlock as exc:
            raise InvalidInput(f"draft for {session.session_id!r}: {exc}") from None
        if block.probs is not None:
            if block.probs.dim() != 2:
                raise InvalidInput(f"draft probs must be [n, vocab], got {tuple(block.probs.shape)}")

    def _check_positions(self, session: Session, layout: StepLayout) -> None:
        needed = session.cached_len + 1 + max(layout.depth)  # positions the step's deepest node uses
        if needed > self.max_context:
            raise ContextTooLong(session.session_id, needed, self.max_context)

    # ---- prefill ---------------------------------------------------------------------------------
    def check_prefill(
        self, session_id: str, prompt_ids: Sequence[int], sampling, hidden_layers, logprobs=None
    ) -> tuple[list[int], tuple[int, ...]]:
        """Every refusal prefill makes of its arguments, before anything is allocated (a caller that allocates for
        the session, as a shared row buffer, checks first): the prompt and the layers, checked."""
        if session_id in self._sessions:
            raise DuplicateSession(session_id)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidInput("prompt_ids: empty")
        self._check_ids(prompt, "prompt_ids")
        if len(prompt) + 1 > self.max_context:  # the pending token needs a position too
            raise ContextTooLong(session_id, len(prompt) + 1, self.max_context)
        layers = self.default_hidden_layers if hidden_layers is None else self._check_layers(tuple(hidden_layers))
        if not isinstance(sampling, SamplingParams):
            raise InvalidInput(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if logprobs is not None and not isinstance(logprobs, LogprobsSpec):
            raise InvalidInput(f"logprobs must be LogprobsSpec, got {type(logprobs).__name__}")
        return prompt, layers

    def prefill(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        hidden_layers: tuple[int, ...] | None = None,
        hidden_out: torch.Tensor | None = None,  # [max_rows, len(layers) * hidden]: the session's row sink
        logprobs: LogprobsSpec | None = None,
    ) -> PrefillResult:
        """Forward the prompt into a new session and sample its first pending token. With ``hidden_out``
        (the engine's dtype and device), every committed hidden row that fits is also written there, row i
        for position i, before the step's result is read back (the same stream: complete on return). With
        ``logprobs`` the result carries the first token's log-probabilities (and the prompt's, if asked), and
        every verify of the session those of its emitted tokens (only then: no cost otherwise)."""
        prompt, layers = self.check_prefill(session_id, prompt_ids, sampling, hidden_layers, logprobs)
        if hidden_out is not None and (
            hidden_out.dim() != 2
            or hidden_out.shape[1] != len(layers) * self.config.hidden_size
            or hidden_out.device.type != self.device.type
            or not layers
        ):
            raise InvalidInput(
                f"hidden_out: {tuple(hidden_out.shape)} on {hidden_out.device} is no row sink for "
                f"{len(layers)} layers of {self.config.hidden_size} on {self.device}"
            )
        n = len(prompt)
        own_rows = hidden_out is None and bool(layers)
        if own_rows:  # the session's rows live in a buffer of the engine's (row i = position i), grown as it goes
            hidden_out = new_rows(n, self.max_context, len(layers) * self.config.hidden_size, self.dtype, self.device)
        table = self.blocks.add(session_id, n)  # raises OutOfBlocks with nothing allocated
        try:
            t0 = time.perf_counter()
            attn = AttentionBatch(
                query_lens=(n,),
                context_lens=(0,),
                block_tables=(table,),
                slot_mapping=self._slots(session_id, 0, n),
                tree_masks=(None,),
            )
            ids = torch.tensor(prompt, dtype=torch.int64, device=self.device)
            pos = torch.arange(n, dtype=torch.int64, device=self.device)
            out = self.model(ids, pos, attn, self.kv_cache, capture_layers=layers)
            if hidden_out is not None:
                fit = min(n, hidden_out.shape[0])
                hidden_out[:fit].copy_(out.captured[:fit])
            logits = self.model.compute_logits(out.hidden[-1:])  # [1, V]
            self._sync()
            t1 = time.perf_counter()
            gen = None if sampling.greedy else make_generator(sampling.seed, self.device, self._seed_key)
            if sampling.greedy:
                first = int(logits[0].argmax())
            else:
                probs = target_probs(logits, sampling)
                first = int(torch.multinomial(probs, 1, generator=gen)[0, 0])
            t2 = time.perf_counter()
            first_lp = prompt_lp = None
            if logprobs is not None:
                first_lp = token_logprobs(logits, self._to_device([first]), logprobs.top)
                if logprobs.prompt:
                    prompt_lp = prompt_logprobs(self.model.compute_logits, out.hidden, ids, logprobs.top)
        except BaseException:
            self.blocks.free(session_id)
            raise
        self._sessions[session_id] = Session(
            session_id, sampling, gen, layers, n, first, hidden_out=hidden_out, logprobs=logprobs, own_rows=own_rows
        )
        return PrefillResult(
            next_token=first,
            hidden=mark_complete(hidden_out[:n]) if own_rows else out.captured,  # (written before the sync)
            timings=StepTimings(forward_ms=(t1 - t0) * 1e3, sample_ms=(t2 - t1) * 1e3),
            logprobs=first_lp,
            prompt_logprobs=prompt_lp,
        )

    # ---- verify ----------------------------------------------------------------------------------
    def verify(self, session_id: str, block: DraftBlock) -> VerifyResult:
        return self.verify_batch([(session_id, block)])[0]

    def decode(self, session_id: str) -> VerifyResult:
        """One target-only step: commit the pending token, sample the next one."""
        return self.verify(session_id, _EMPTY)

    def verify_batch(self, items: Sequence[tuple[str, DraftBlock]]) -> list[VerifyResult]:
        """Verify several sessions' blocks in ONE forward; results in the order of ``items``."""
        started = time.perf_counter()  # each result's compute_ms: from here to its own result
        steps = self._prepare(items)
        timer = StepTimer(self.device)
        try:
            run = self._forward(steps)
        except BaseException:
            self._rollback(steps)
            raise
        timer.stop()
        results: list[VerifyResult] = []
        try:
            for step in steps:
                results.append(self._accept(step, run, timer, started))
        except BaseException:
            self._rollback(steps[len(results) :])  # sessions not accepted yet keep their old state
            raise
        return results

    def score_block(self, session_id: str, block: DraftBlock) -> torch.Tensor:  # [n+1, V] float32
        """Target logits at every node of ``[pending] + block`` without committing anything."""
        steps = self._prepare([(session_id, block)])
        try:
            logits = self._forward(steps).logits
        finally:
            self._rollback(steps)
        return logits

    def _prepare(self, items: Sequence[tuple[str, DraftBlock]]) -> list[BatchStep]:
        if not items:
            raise InvalidInput("verify_batch got no sessions")
        seen: set[str] = set()
        steps: list[BatchStep] = []
        start = 0
        for session_id, block in items:
            if session_id in seen:
                raise InvalidInput(f"session {session_id!r} appears twice in one verify batch")
            seen.add(session_id)
            session = self._get(session_id)
            self._check_block(session, block)
            step = BatchStep(session, block, layout_of(block), start)
            self._check_positions(session, step.layout)
            steps.append(step)
            start = step.end
        grown: list[BatchStep] = []
        try:
            for step in steps:
                s = step.session
                self.blocks.grow(s.session_id, s.cached_len + step.layout.num_nodes)
                grown.append(step)
        except OutOfBlocks:
            self._rollback(grown)
            raise
        return steps

    def _rollback(self, steps: Sequence[BatchStep]) -> None:
        for step in steps:
            self.blocks.truncate(step.session.session_id, step.session.cached_len)

    def _slots(self, session_id: str, start: int, end: int) -> torch.Tensor:  # [end - start] int64
        return self._to_device(self.blocks.slots(session_id, start, end))

    def _to_device(self, values: Sequence[int]) -> torch.Tensor:  # [n] int64 on the engine's device
        """A small index list on the device without blocking the host (pinned staging, asynchronous copy)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _forward(self, steps: Sequence[BatchStep]):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        masks: list[torch.Tensor | None] = []
        for step in steps:
            s = step.session
            ids.append(s.pending_token)
            ids.extend(step.block.token_ids)
            pos.extend(step.layout.positions(s.cached_len))
            slots.extend(self.blocks.slots(s.session_id, s.cached_len, s.cached_len + step.layout.num_nodes))
            masks.append(None if step.layout.is_chain else step.layout.attention_mask())
        attn = AttentionBatch(
            query_lens=tuple(step.layout.num_nodes for step in steps),
            context_lens=tuple(step.session.cached_len for step in steps),
            block_tables=tuple(self.blocks.block_table(step.session.session_id) for step in steps),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),  # on the host: the runner stages it
            tree_masks=tuple(masks),
        )
        capture = tuple(sorted({i for step in steps for i in step.session.hidden_layers}))
        return self.runner.run(ids, pos, attn, capture)  # logits [T, V]: graph replay or eager

    def _read_summary(self, step: BatchStep, run: RunOutput) -> tuple[int, int, int]:
        """(last accepted node, next token, distinct experts): the step's one device read."""
        s, block, layout = step.session, step.block, step.layout
        if run.summary is not None and s.sampling.greedy and layout.is_chain:  # the graph computed all three
            self._summary_host.copy_(run.summary, non_blocking=True)
            self._summary_read.record()
            self._summary_read.synchronize()
            last, nxt, experts = self._summary_host.tolist()
            return last, nxt, experts
        tokens = self._to_device(block.token_ids)
        last, nxt_t = verify_step_device(
            layout, tokens, run.logits[step.start : step.end], block.probs, s.sampling, s.generator
        )
        routed = run.out.routed_experts
        experts_t = distinct_experts(
            None if routed is None else routed[:, step.start : step.end], self._num_experts, last.device
        )
        last, nxt, experts = torch.stack([last, nxt_t, experts_t]).tolist()
        return last, nxt, experts

    def _accept(self, step: BatchStep, run: RunOutput, timer: StepTimer, started: float) -> VerifyResult:
        out, capture = run.out, run.captured_layers
        s, block, layout = step.session, step.block, step.layout
        t0 = time.perf_counter()
        if s.own_rows and layout.is_chain:
            grow_rows(s, s.cached_len + layout.num_nodes, self.max_context)
        sink, written = s.hidden_out, 0
        if sink is not None and layout.is_chain:  # node j is position cached_len + j: write before the read
            written = max(0, min(layout.num_nodes, sink.shape[0] - s.cached_len))
            if written:
                rows_out = out.captured[step.start : step.start + written]
                sink[s.cached_len : s.cached_len + written].copy_(
                    self._columns.select(rows_out, capture, s.hidden_layers)
                )
        last_node, nxt, experts = self._read_summary(step, run)
        path = layout.path_to(last_node)[1:]
        t1 = time.perf_counter()
        committed = (0,) + path
        emitted_lp = None
        if s.logprobs is not None:  # emitted token i was drawn at committed node i
            rows = self._to_device([step.start + j for j in committed])
            tokens = self._to_device([*(block.token_ids[j - 1] for j in path), nxt])
            emitted_lp = token_logprobs(run.logits.index_select(0, rows), tokens, s.logprobs.top)
        hidden = None
        if s.hidden_layers and len(committed) <= written:
            hidden = mark_complete(sink[s.cached_len : s.cached_len + len(committed)])  # written before the read
        elif s.hidden_layers:
            rows = self._to_device([step.start + j for j in committed])
            hidden = self._columns.select(out.captured.index_select(0, rows), capture, s.hidden_layers)
            if sink is not None and not layout.is_chain:  # a tree's path is known only now: write, then wait
                if s.own_rows:
                    grow_rows(s, s.cached_len + len(committed), self.max_context)
                    sink = s.hidden_out
                fit = max(0, min(len(committed), sink.shape[0] - s.cached_len))
                if fit:
                    sink[s.cached_len : s.cached_len + fit].copy_(hidden[:fit])
                    if s.own_rows:  # the rows as a view of it, like a chain's
                        hidden = sink[s.cached_len : s.cached_len + fit]
                    else:  # a shared buffer another process reads: complete before the reply
                        self._sync()
        # commit: accepted path to contiguous slots, drop the rest (nothing above may change state)
        src, dst = compaction_moves(committed)
        if src:
            slots = self.blocks.slots(s.session_id, s.cached_len, s.cached_len + layout.num_nodes)
            self.kv_cache.copy_slots(
                self._to_device([slots[j] for j in src]),
                self._to_device([slots[j] for j in dst]),
            )
        new_len = s.cached_len + len(committed)
        self.blocks.truncate(s.session_id, new_len)
        s.cached_len = new_len
        s.pending_token = nxt
        s.steps += 1
        return VerifyResult(
            accepted_ids=tuple(block.token_ids[j - 1] for j in path),
            next_token=nxt,
            hidden=hidden,
            num_drafted=len(block),
            experts_touched=experts,
            timings=StepTimings(
                forward_ms=timer.ms(), sample_ms=(t1 - t0) * 1e3, compute_ms=(time.perf_counter() - started) * 1e3
            ),
            logprobs=emitted_lp,
        )

    # ---- lifecycle -------------------------------------------------------------------------------
    def release(self, session_id: str) -> bool:
        """Free a session's blocks; False when it was not open (releasing twice is harmless)."""
        if self._sessions.pop(session_id, None) is None:
            return False
        self.blocks.free(session_id)
        return True

    def generate_greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """Reference target-only greedy decode (one token per step); returns the new token ids."""
        if max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sid = f"__greedy_reference_{id(prompt_ids)}_{time.monotonic_ns()}"
        out = [self.prefill(sid, prompt_ids, SamplingParams(), ()).next_token]
        try:
            eos = set(self._info.eos_token_ids) if stop_at_eos else set()
            while len(out) < max_new_tokens and out[-1] not in eos:
                out.append(self.decode(sid).next_token)
        finally:
            self.release(sid)
        return out

    def _sync(self) -> None:
        """Wait for the work this thread queued (its current stream), not the whole device: in one process a
        drafter's kernels on its own stream (runtime/device_stream.py) must not hold up a prefill."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
