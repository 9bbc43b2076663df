"""Plain data that crosses the engine boundary (no model code here).

Speculative-decoding glossary, used unchanged in code, protos, metric names and span attributes:

- **pending token**: the newest emitted token of a sequence. It has been sampled by the target but
  its K/V is not in the target's cache yet; the next verify step feeds it first.
- **drafted** tokens: the block (chain or tree) a proposer offers after the pending token.
- **accepted** tokens: the longest prefix (tree: root-to-leaf path) of drafted tokens that the
  target's acceptance rule keeps. Their K/V stays in the cache.
- **rejected** tokens: drafted tokens after the first refusal. They never become visible: the
  sequence length stops before them and their cache slots are reused.
- **recovered** token: the token the target samples at the first refused position, from the
  residual distribution norm(max(0, p - q)) (greedy: the target argmax).
- **bonus** token: the token sampled from the target after the last drafted token when every drafted
  token was accepted.
- **emitted** tokens of a step: accepted + one (recovered or bonus). The recovered or bonus token
  becomes the new pending token. "Accepted length" of a step = accepted + 1.

torch is imported only by the functions that compute on tensors (``join_hidden``, ``check_block``): a process that
only speaks the wire (``specserve client``, the gateway's conversions) never loads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.contract.speculation import DEFAULT_K

if TYPE_CHECKING:
    import torch

# Temperatures below the smallest normal float32 cannot scale float32 logits (the quotient overflows
# and the distribution becomes NaN); such a request decodes as greedy, the limit of sampling as T -> 0.
MIN_SAMPLED_TEMPERATURE = 1.1754943508222875e-38


class BadSampling(ValueError):
    """A sampling setting no request may have; ``field`` names it (temperature, top_p, top_k)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 (or below MIN_SAMPLED_TEMPERATURE) means greedy.

    The one check of these rules: the gateway (gateway/validation.py), the target and the draft (their
    sampling_from_proto) all refuse through it, with the same message."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise BadSampling("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # NaN and inf fail this too
            raise BadSampling("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadSampling("top_k", f"must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLED_TEMPERATURE


@dataclass(frozen=True)
class DraftBlock:
    """Drafted tokens offered after the pending token.

    A chain has ``parents is None`` (token i follows token i-1; token 0 follows the pending token).
    A tree gives ``parents[i]`` = index of the parent node, or -1 for a child of the pending token;
    parents always come before children (``parents[i] < i``).
    """

    token_ids: tuple[int, ...]  # [n]
    parents: tuple[int, ...] | None = None  # [n] or None for a chain
    probs: torch.Tensor | None = None  # [n, vocab] float32 draft distribution q of each node; None = one-hot
    # [n] a chain's chance that each drafted token is accepted given the ones before it were (a drafter's confidence
    # head: draft_service/dspark.py); () = none. It only guides how many are verified (specserve/loop/verify_length.py)
    confidence: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.confidence:
            if len(self.confidence) != n or self.parents is not None:
                raise ValueError(
                    f"confidence has {len(self.confidence)} entries for a {n}-token "
                    f"{'chain' if self.parents is None else 'tree'} (chains only, one per token)"
                )
            if not all(0.0 <= c <= 1.0 for c in self.confidence):  # NaN fails too
                raise ValueError("confidence: every entry must be in [0, 1]")
        if self.parents is not None:
            if len(self.parents) != n:
                raise ValueError(f"parents has {len(self.parents)} entries for {n} tokens")
            for i, p in enumerate(self.parents):
                if not -1 <= p < i:
                    raise ValueError(f"parents[{i}] = {p} must be in [-1, {i})")
        if self.probs is not None and tuple(self.probs.shape[:1]) != (n,):
            raise ValueError(f"probs has shape {tuple(self.probs.shape)} for {n} tokens")

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepTimings:
    queue_ms: float = 0.0
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    total_ms: float = 0.0  # a service's whole handling of the call, receipt to reply (0 when in process)
    compute_ms: float = 0.0  # the model's own call on its thread (engine verify / proposer propose), nothing around it


@dataclass(frozen=True)
class SharedRows:
    """Hidden rows [start, stop) of S's positions that the target wrote into the session's shared buffer
    (specserve/runtime/hidden_share.py), carried instead of the rows themselves: the gateway relays them,
    the drafter reads them there. ``handle`` is the buffer's opaque handle (the wire message), set on
    the first range of a session (its prefill); ``tail`` [m, F] holds rows after ``stop`` that came as
    bytes (a session that outgrew its buffer)."""

    start: int
    stop: int
    handle: object | None = None
    tail: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"SharedRows: [{self.start}, {self.stop}) is not a row range")

    @property
    def num_rows(self) -> int:
        return self.stop - self.start + (0 if self.tail is None else int(self.tail.shape[0]))


if TYPE_CHECKING:
    Hidden = torch.Tensor | SharedRows  # a step's hidden rows: the rows, or where they are (for annotations only)


def join_hidden(parts: Sequence[Hidden]) -> Hidden:
    """Consecutive steps' hidden rows as one: tensors are concatenated, contiguous ranges merged, and
    rows that came as bytes after a range become its tail (a range after bytes cannot be: a session
    whose buffer overflowed sends bytes from then on)."""
    import torch

    if all(isinstance(p, torch.Tensor) for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)
    first = parts[0]
    if not isinstance(first, SharedRows):
        raise ValueError("hidden rows: a shared range after rows sent as bytes")
    stop, handle, tails = first.stop, first.handle, [] if first.tail is None else [first.tail]
    for p in parts[1:]:
        if isinstance(p, torch.Tensor):
            tails.append(p)
            continue
        if tails or p.start != stop:
            raise ValueError(f"hidden rows: range [{p.start}, {p.stop}) does not follow the rows before it (to {stop})")
        stop = p.stop
        if p.tail is not None:
            tails.append(p.tail)
    tail = None if not tails else tails[0] if len(tails) == 1 else torch.cat(tails, dim=0)
    return SharedRows(first.start, stop, handle, tail)


MAX_TOP_LOGPROBS = 20  # most alternatives per token a request may ask for (the OpenAI API's top_logprobs limit)


@dataclass(frozen=True)
class LogprobsSpec:
    """What a request asks of the target's log-probabilities (log_softmax of its float32 logits, before
    temperature and top-p: the model's own distribution, as evaluation tools read it)."""

    top: int = 0  # alternatives per token (the most likely ones), 0 .. MAX_TOP_LOGPROBS
    prompt: bool = False  # also each prompt token after the first, scored at the position before it

    def __post_init__(self) -> None:
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs: {self.top} alternatives, expected 0 .. {MAX_TOP_LOGPROBS}")


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities of n tokens, and the ``top`` most likely tokens at each position."""

    token_ids: tuple[int, ...]  # [n]
    logprobs: tuple[float, ...]  # [n]
    top_ids: tuple[tuple[int, ...], ...] = ()  # [n][top], most likely first
    top_logprobs: tuple[tuple[float, ...], ...] = ()  # [n][top]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if (
            len(self.logprobs) != n
            or len(self.top_ids) != len(self.top_logprobs)
            or self.top_ids
            and len(self.top_ids) != n
        ):
            raise ValueError(f"token logprobs: {n} tokens, {len(self.logprobs)} logprobs, {len(self.top_ids)} top rows")

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> TokenLogprobs:
        """The first n tokens' entries."""
        return TokenLogprobs(self.token_ids[:n], self.logprobs[:n], self.top_ids[:n], self.top_logprobs[:n])


@dataclass(frozen=True)
class PrefillResult:
    next_token: int  # the first pending token, sampled from the prompt's last position
    # [prompt_len, len(hidden_layers) * hidden_size], its SharedRows (a service's shared buffer), or None
    hidden: Hidden | None
    timings: StepTimings = field(default_factory=StepTimings)
    logprobs: TokenLogprobs | None = None  # of next_token, when the session asked (LogprobsSpec)
    prompt_logprobs: TokenLogprobs | None = None  # of prompt tokens 1 .. n-1, when asked (LogprobsSpec.prompt)


@dataclass(frozen=True)
class VerifyResult:
    accepted_ids: tuple[int, ...]  # accepted drafted tokens, in sequence order
    next_token: int  # recovered or bonus token: the new pending token
    # [1 + len(accepted_ids), len(hidden_layers) * hidden_size]: features of the old pending token
    # and the accepted tokens (the positions whose K/V this step committed), their SharedRows, or None
    hidden: Hidden | None
    num_drafted: int = 0
    experts_touched: int = 0  # distinct routed experts the verify forward read (summed over MoE layers)
    timings: StepTimings = field(default_factory=StepTimings)
    logprobs: TokenLogprobs | None = None  # of the emitted tokens, when the session asked (LogprobsSpec)

    @property
    def emitted(self) -> tuple[int, ...]:
        return self.accepted_ids + (self.next_token,)


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 style dynamic tree: expand ``top_k`` children of the best nodes for ``depth`` levels,
    keep the best ``num_nodes`` nodes by cumulative draft probability."""

    num_nodes: int
    top_k: int
    depth: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"TreeSpec.num_nodes must be >= 1, got {self.num_nodes}")
        if self.top_k < 1:
            raise ValueError(f"TreeSpec.top_k must be >= 1, got {self.top_k}")
        if self.depth < 1:
            raise ValueError(f"TreeSpec.depth must be >= 1, got {self.depth}")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation request as every part speaks it, from the gateway's validation to the spec loop."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_speculative_tokens: int = DEFAULT_K  # 0 = the draft's default (at the gateway, before a draft is chosen)
    tree: TreeSpec | None = None  # a tree request; None = chain
    stop: tuple[str, ...] = ()
    model_name: str = ""
    adaptive: bool = False
    draft_ahead: bool = False
    draft_name: str | None = None  # the gateway's draft for this request; None = target-only
    # False: proposal-only verification. The drafter's q is not sent to the target; each drafted token
    # is verified as a deterministic proposal (accepted with probability p(x), recovered from p with x
    # removed), which is lossless whatever the drafter sends. True: q is used (min(1, p/q), recovery
    # from norm(max(0, p - q))), which accepts more but is lossless only if q is what x was drawn from.
    trust_draft_probs: bool = True
    logprobs: LogprobsSpec | None = None  # the target's log-probabilities of each emitted (and prompt) token

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")


class InvalidBlock(ValueError):
    """A drafted block that no verifier may use (the caller maps it to its own error)."""


class BadProbs(InvalidBlock):
    """A drafted block whose q is no distribution the acceptance rule can use (it could force tokens)."""


PROB_SUM_TOLERANCE = 1e-3  # |sum(q row) - 1| allowed in a drafted block (float32 sums over a vocabulary)


def check_block(
    token_ids: Sequence[int],  # [n]
    probs: torch.Tensor | None,  # [n, vocab] or None
    vocab_size: int,
    max_nodes: int | None = None,
) -> None:
    """The one draft-block check: at most max_nodes tokens, every id in [0, vocab_size), and probs (when given) a
    finite, non-negative [n, vocab_size] tensor whose rows each sum to 1 (within PROB_SUM_TOLERANCE) and give
    each drafted token q(x) > 0 (a q(x) of 0 would make min(1, p/q) accept x whatever p says). Raises
    InvalidBlock naming the problem (BadProbs for a problem of probs)."""
    import torch

    n = len(token_ids)
    if max_nodes is not None and n > max_nodes:
        raise InvalidBlock(f"drafted {n} tokens, asked for at most {max_nodes}")
    bad = [int(t) for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidBlock(f"token ids {bad[:4]} outside the vocabulary [0, {vocab_size})")
    if probs is None:
        return
    if probs.dim() != 2 or tuple(probs.shape) != (n, vocab_size):
        raise InvalidBlock(f"probs: shape {tuple(probs.shape)}, expected ({n}, {vocab_size})")
    if not bool(torch.isfinite(probs).all()):
        raise BadProbs("probs: contains NaN or inf")
    if bool((probs < 0).any()):
        raise BadProbs("probs: contains negative entries")
    if not n:
        return
    sums = probs.double().sum(-1)
    off = int((sums - 1).abs().argmax())
    if abs(float(sums[off]) - 1) > PROB_SUM_TOLERANCE:
        raise BadProbs(f"probs: row {off} sums to {float(sums[off]):.6g}, not 1")
    qx = probs[torch.arange(n), torch.tensor([int(t) for t in token_ids], dtype=torch.long)]
    if bool((qx <= 0).any()):
        i = int(torch.nonzero(qx <= 0)[0, 0])
        raise BadProbs(f"probs: q of drafted token {i} (id {int(token_ids[i])}) is 0")
