"""Conversions between the contract types (specserve/contract/types.py) and specserve.v1 messages.

Every ``from_proto`` direction validates what arrived on the wire and raises ``ConversionError``
(a ValueError) naming the field; servers map it to INVALID_ARGUMENT.

numpy and torch are imported only by the two tensor conversions: a process that converts no tensor (``specserve
client``; the gateway's own messages) never loads them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specserve.contract.types import (
    DraftBlock,
    GenerationRequest,
    InvalidBlock,
    LogprobsSpec,
    PrefillResult,
    SamplingParams,
    SharedRows,
    StepTimings,
    TokenLogprobs,
    TreeSpec,
    VerifyResult,
    check_block,
)
from specserve.protos.specserve.v1 import common_pb2, draft_pb2, target_pb2

if TYPE_CHECKING:
    import torch

    from specserve.contract.types import Hidden

_F32_LE = "<f4"  # the wire's float32 byte order (a numpy dtype string)


class ConversionError(ValueError):
    """A message could not be converted: the text names the field and the problem."""


# ------------------------------------------------------------------------------------ GetInfo
def info_to_proto(msg_cls, info, **extra):
    """A GetInfo reply (TargetInfo, DraftInfo): every field of the message that the ``info`` dataclass (the
    engine's EngineInfo, the drafter's DrafterInfo) has, then ``extra`` (what the service itself adds)."""
    wire = {f.name for f in msg_cls.DESCRIPTOR.fields}
    return msg_cls(**{f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name in wire}, **extra)


# ---------------------------------------------------------------------------------------- tensors
def tensor_to_proto(t: torch.Tensor | None) -> common_pb2.Tensor | None:
    """A tensor of any float dtype / device -> little-endian float32 row-major bytes (None -> None)."""
    if t is None:
        return None
    import torch

    arr = t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return common_pb2.Tensor(shape=list(arr.shape), data=arr.astype(_F32_LE, copy=False).tobytes())


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """A Tensor message -> a float32 CPU tensor (a private copy; the message's bytes are not shared)."""
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise ConversionError(f"{field}: negative dimension in shape {shape}")
    numel = math.prod(shape)
    if len(msg.data) != 4 * numel:
        raise ConversionError(f"{field}: {len(msg.data)} bytes of data for shape {shape} (expected {4 * numel})")
    import numpy as np
    import torch

    arr = np.frombuffer(msg.data, dtype=_F32_LE).astype(np.float32, copy=True).reshape(shape)
    return torch.from_numpy(arr)


def optional_tensor(parent, name: str, field: str | None = None) -> torch.Tensor | None:
    """parent.<name> as a tensor when the message field is set, else None."""
    if not parent.HasField(name):
        return None
    return tensor_from_proto(getattr(parent, name), field or name)


# ----------------------------------------------------------------------------------- sampling
def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Wire -> SamplingParams; top_p 0 on the wire means unset (1.0). Raises the contract's BadSampling."""
    top_p = msg.top_p if msg.top_p != 0.0 else 1.0
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(temperature=msg.temperature, top_p=top_p, top_k=msg.top_k, seed=seed)


def sampling_from_proto(msg: common_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    """``sampling_params``, its refusal a ConversionError naming ``field.<setting>`` (the services' INVALID_ARGUMENT)."""
    try:
        return sampling_params(msg)
    except ValueError as e:
        raise ConversionError(f"{field}.{e}") from None


# --------------------------------------------------------------------------------- draft blocks
def draft_block_to_proto(block: DraftBlock) -> common_pb2.DraftBlock:
    msg = common_pb2.DraftBlock(token_ids=list(block.token_ids), is_tree=not block.is_chain)
    if block.parents is not None:
        msg.parents.extend(block.parents)
    if block.probs is not None:
        msg.probs.CopyFrom(tensor_to_proto(block.probs))
        msg.has_probs = True
    msg.confidence.extend(block.confidence)
    return msg


def draft_block_from_proto(
    msg: common_pb2.DraftBlock, vocab_size: int | None = None, field: str = "draft"
) -> DraftBlock:
    """Wire -> DraftBlock. With vocab_size, also checks ids are in [0, vocab) and probs is [n, vocab]
    with finite, non-negative entries (what a verifier needs to trust a block)."""
    ids = tuple(int(t) for t in msg.token_ids)
    parents: tuple[int, ...] | None = None
    if msg.is_tree:
        parents = tuple(int(p) for p in msg.parents)
    elif len(msg.parents):
        raise ConversionError(f"{field}.parents: set on a chain (is_tree is false)")
    probs = tensor_from_proto(msg.probs, f"{field}.probs") if msg.has_probs else None
    if vocab_size is not None:
        check_block_values(ids, probs, vocab_size, field)
    try:
        return DraftBlock(token_ids=ids, parents=parents, probs=probs, confidence=tuple(msg.confidence))
    except ValueError as e:
        raise ConversionError(f"{field}: {e}") from None


def check_block_values(ids: Sequence[int], probs: torch.Tensor | None, vocab_size: int, field: str = "draft") -> None:
    """Raise ConversionError unless the block passes the contract's check_block."""
    try:
        check_block(ids, probs, vocab_size)
    except InvalidBlock as exc:
        raise ConversionError(f"{field}: {exc}") from None


# ------------------------------------------------------------------------------------ timings
def timings_to_proto(t: StepTimings, total_ms: float = 0.0, queue_ms: float | None = None):
    """StepTimings -> wire; queue_ms (measured by the server) overrides the engine's value."""
    return common_pb2.StepTimings(
        queue_ms=t.queue_ms if queue_ms is None else queue_ms,
        forward_ms=t.forward_ms,
        sample_ms=t.sample_ms,
        total_ms=total_ms,
        compute_ms=t.compute_ms,
    )


def timings_from_proto(msg: common_pb2.StepTimings) -> StepTimings:
    return StepTimings(
        queue_ms=msg.queue_ms,
        forward_ms=msg.forward_ms,
        sample_ms=msg.sample_ms,
        total_ms=msg.total_ms,
        compute_ms=msg.compute_ms,
    )


# ------------------------------------------------------------------------------------- trees
def tree_spec_to_proto(num_nodes: int, top_k: int, depth: int) -> draft_pb2.TreeSpec:
    return draft_pb2.TreeSpec(num_nodes=num_nodes, top_k=top_k, depth=depth)


# ----------------------------------------------------------------------------------- logprobs
def logprobs_spec_to_proto(spec: LogprobsSpec) -> common_pb2.LogprobsSpec:
    return common_pb2.LogprobsSpec(top=spec.top, prompt=spec.prompt)


def logprobs_spec_from_proto(parent, name: str = "logprobs") -> LogprobsSpec | None:
    """parent.<name> as a LogprobsSpec when the field is set, else None (no logprobs asked)."""
    if not parent.HasField(name):
        return None
    msg = getattr(parent, name)
    try:
        return LogprobsSpec(top=msg.top, prompt=msg.prompt)
    except ValueError as e:
        raise ConversionError(str(e)) from None


def token_logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    top = len(lp.top_ids[0]) if lp.top_ids else 0
    return common_pb2.TokenLogprobs(
        token_ids=list(lp.token_ids),
        logprobs=list(lp.logprobs),
        top=top,
        top_ids=[t for row in lp.top_ids for t in row],
        top_logprobs=[v for row in lp.top_logprobs for v in row],
    )


def token_logprobs_from_proto(parent, name: str = "logprobs") -> TokenLogprobs | None:
    """parent.<name> as TokenLogprobs when the field is set, else None; the lengths must agree."""
    if not parent.HasField(name):
        return None
    msg = getattr(parent, name)
    n, top = len(msg.token_ids), msg.top
    if len(msg.logprobs) != n or top < 0 or len(msg.top_ids) != n * top or len(msg.top_logprobs) != n * top:
        raise ConversionError(
            f"{name}: {n} tokens, {len(msg.logprobs)} logprobs and {len(msg.top_ids)} top ids do not fit top = {top}"
        )
    ids, values = list(msg.top_ids), list(msg.top_logprobs)
    rows = range(n) if top else range(0)
    return TokenLogprobs(
        tuple(msg.token_ids),
        tuple(msg.logprobs),
        tuple(tuple(ids[i * top : (i + 1) * top]) for i in rows),
        tuple(tuple(values[i * top : (i + 1) * top]) for i in rows),
    )


def tree_spec_from_proto(msg: draft_pb2.TreeSpec, field: str = "tree") -> TreeSpec:
    try:
        return TreeSpec(num_nodes=msg.num_nodes, top_k=msg.top_k, depth=msg.depth)
    except ValueError as e:
        raise ConversionError(f"{field}: {e}") from None


# ------------------------------------------------------------------------------- hidden rows
def hidden_to_proto(out, hidden: Hidden | None) -> None:
    """Set a reply's hidden rows (PrefillResponse, VerifyResponse): their range of the session's shared
    buffer (and the buffer's handle, a HiddenShare message, on the first range), or the rows as bytes."""
    if isinstance(hidden, SharedRows):
        if hidden.handle is not None:
            out.hidden_share.CopyFrom(hidden.handle)
        out.hidden_rows.CopyFrom(common_pb2.HiddenRows(start=hidden.start, stop=hidden.stop))
    elif hidden is not None:
        out.hidden.CopyFrom(tensor_to_proto(hidden))


def hidden_from_proto(msg, handle: common_pb2.HiddenShare | None = None) -> Hidden | None:
    """A reply's hidden rows: the tensor it carries, the range of the shared buffer it names, or None."""
    if not msg.HasField("hidden_rows"):
        return optional_tensor(msg, "hidden")
    try:
        return SharedRows(int(msg.hidden_rows.start), int(msg.hidden_rows.stop), handle=handle)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


def request_hidden_from_proto(request, tensor_field: str, rows_field: str) -> Hidden | None:
    """A draft request's hidden rows (StartSession: hidden / hidden_rows; Propose: append_hidden / append_rows): the
    tensor of ``tensor_field``, or, ``rows_field`` set, that range of the session's shared buffer with the tensor's
    rows after it as its tail (rows that came as bytes). Decoding copies the bytes: a servicer runs it on the model's
    thread."""
    tensor = optional_tensor(request, tensor_field)
    if not request.HasField(rows_field):
        return tensor
    r = getattr(request, rows_field)
    try:
        return SharedRows(int(r.start), int(r.stop), tail=tensor)
    except ValueError:
        raise ConversionError(f"{rows_field}: [{r.start}, {r.stop}) is not a row range") from None


def propose_response_to_proto(
    session_id: str, block: common_pb2.DraftBlock, total_ms: float, compute_ms: float
) -> draft_pb2.ProposeResponse:
    """A proposal's reply: its block (already a message: encoded on the drafter thread) and its times."""
    return draft_pb2.ProposeResponse(
        session_id=session_id,
        draft=block,
        timings=common_pb2.StepTimings(forward_ms=total_ms, total_ms=total_ms, compute_ms=compute_ms),
    )


# ------------------------------------------------------------------------- prefill and verify
def prefill_result_to_proto(session_id: str, res: PrefillResult, total_ms: float) -> target_pb2.PrefillResponse:
    out = target_pb2.PrefillResponse(
        session_id=session_id, next_token=res.next_token, timings=timings_to_proto(res.timings, total_ms)
    )
    hidden_to_proto(out, res.hidden)
    if res.logprobs is not None:
        out.logprobs.CopyFrom(token_logprobs_to_proto(res.logprobs))
    if res.prompt_logprobs is not None:
        out.prompt_logprobs.CopyFrom(token_logprobs_to_proto(res.prompt_logprobs))
    return out


def prefill_result_from_proto(msg: target_pb2.PrefillResponse) -> PrefillResult:
    """ConversionError: hidden rows that are no range or no tensor, logprobs whose lengths disagree."""
    return PrefillResult(
        next_token=msg.next_token,
        hidden=hidden_from_proto(msg, msg.hidden_share if msg.HasField("hidden_share") else None),
        timings=timings_from_proto(msg.timings),
        logprobs=token_logprobs_from_proto(msg),
        prompt_logprobs=token_logprobs_from_proto(msg, "prompt_logprobs"),
    )


def verify_result_to_proto(
    session_id: str, res: VerifyResult, num_drafted: int, total_ms: float, queue_ms: float, batch_size: int
) -> target_pb2.VerifyResponse:
    out = target_pb2.VerifyResponse(
        session_id=session_id,
        accepted_ids=list(res.accepted_ids),
        next_token=res.next_token,
        num_drafted=num_drafted,
        experts_touched=res.experts_touched,
        timings=timings_to_proto(res.timings, total_ms, queue_ms),
        batch_size=batch_size,
    )
    hidden_to_proto(out, res.hidden)
    if res.logprobs is not None:
        out.logprobs.CopyFrom(token_logprobs_to_proto(res.logprobs))
    return out


def verify_result_from_proto(msg: target_pb2.VerifyResponse) -> VerifyResult:
    """ConversionError: hidden rows that are no range or no tensor, logprobs whose lengths disagree."""
    return VerifyResult(
        accepted_ids=tuple(msg.accepted_ids),
        next_token=msg.next_token,
        hidden=hidden_from_proto(msg),
        num_drafted=msg.num_drafted,
        experts_touched=msg.experts_touched,
        timings=timings_from_proto(msg.timings),
        logprobs=token_logprobs_from_proto(msg),
    )


# ------------------------------------------------------------------- the target's own loop (Run)
def run_request_to_proto(
    gen: GenerationRequest,
    session_id: str,
    draft_address: str,
    draft_step_timeout_s: float,
    reserve_tokens: int,
    breaker_failures: int = 0,
    probe_every_s: float = 0.0,
    shm: bool = True,
    hidden_share: bool = True,
) -> target_pb2.RunRequest:
    """A validated request for the target's step loop (its stop strings stay with the gateway: the text cut)."""
    msg = target_pb2.RunRequest(
        session_id=session_id,
        prompt_ids=list(gen.prompt_ids),
        max_new_tokens=gen.max_new_tokens,
        sampling=sampling_to_proto(gen.sampling),
        num_speculative_tokens=gen.num_speculative_tokens,
        adaptive=gen.adaptive,
        draft_ahead=gen.draft_ahead,
        trust_draft_probs=gen.trust_draft_probs,
        model_name=gen.model_name,
        draft_address=draft_address,
        draft_name=gen.draft_name or "",
        draft_step_timeout_s=draft_step_timeout_s,
        reserve_tokens=reserve_tokens,
        draft_breaker_failures=breaker_failures,
        draft_probe_every_s=probe_every_s,
        no_draft_shm=not shm,
        no_hidden_share=not hidden_share,
    )
    if gen.tree is not None:
        msg.tree_nodes, msg.tree_top_k, msg.tree_depth = gen.tree.num_nodes, gen.tree.top_k, gen.tree.depth
    if gen.logprobs is not None:
        msg.logprobs.CopyFrom(logprobs_spec_to_proto(gen.logprobs))
    return msg


def run_request_from_proto(msg: target_pb2.RunRequest) -> GenerationRequest:
    """The RunRequest as the loop's GenerationRequest (ConversionError naming the field on a bad one)."""
    tree = None
    if msg.tree_nodes:
        tree = tree_spec_from_proto(
            draft_pb2.TreeSpec(num_nodes=msg.tree_nodes, top_k=msg.tree_top_k, depth=msg.tree_depth)
        )
    if not msg.session_id:
        raise ConversionError("session_id: empty")
    if msg.draft_address and not msg.draft_step_timeout_s > 0:
        raise ConversionError(f"draft_step_timeout_s: must be > 0, got {msg.draft_step_timeout_s}")
    try:
        return GenerationRequest(
            prompt_ids=tuple(msg.prompt_ids),
            max_new_tokens=msg.max_new_tokens,
            sampling=sampling_from_proto(msg.sampling),
            num_speculative_tokens=msg.num_speculative_tokens if msg.draft_address else 0,
            tree=tree,
            model_name=msg.model_name,
            adaptive=msg.adaptive and bool(msg.draft_address),
            draft_ahead=msg.draft_ahead,
            draft_name=(msg.draft_name or msg.draft_address) if msg.draft_address else None,
            trust_draft_probs=msg.trust_draft_probs,
            logprobs=logprobs_spec_from_proto(msg),
        )
    except ValueError as e:
        raise ConversionError(str(e)) from None


def spec_stats_to_proto(stats: dict) -> common_pb2.SpecStats:
    """A request's statistics (SpecStats.as_dict())."""
    return common_pb2.SpecStats(
        steps=stats["steps"],
        mean_accepted_length=stats["mean_accepted_length"],
        accepted_per_position=stats["accepted_per_position"],
        tokens_per_s=stats["tokens_per_s"],
        ttft_s=stats["ttft_s"],
        draft_fallback=bool(stats.get("draft_fallback", False)),
        draft_ms=stats.get("draft_ms", 0.0),
        draft_hidden_ms=stats.get("draft_hidden_ms", 0.0),
        draft_ahead_hits=stats.get("draft_ahead_hits", 0),
        chosen_k=stats.get("chosen_k", {}),
    )
