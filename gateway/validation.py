"""Check a GenerateRequest before any service sees it; every error names the offending field."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

from specserve.contract.speculation import MAX_K
from specserve.contract.types import BadSampling, GenerationRequest, TreeSpec
from specserve.errors import SpecserveError
from specserve.protos import convert
from specserve.protos.specserve.v1 import gateway_pb2, target_pb2

MAX_TREE_TOP_K = 16  # children per tree node (the draft service has its own --max-tree-top-k)
MAX_TREE_DEPTH = MAX_K
DEFAULT_TREE_TOP_K = 2  # children expanded per node when a tree request leaves tree_top_k at 0
DEFAULT_TREE_DEPTH = 4  # levels when a tree request leaves tree_depth at 0
NO_DRAFT = "none"  # GenerateRequest.draft value that asks for target-only decoding


@dataclass(frozen=True)
class RequestLimits:
    """The gateway's per-request limits (flags of `specserve gateway`); 0 = the model's context."""

    max_prompt_tokens: int = 0
    max_new_tokens: int = 4096
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters per stop string

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "max_stop_strings", "max_stop_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens == 0:
            raise ValueError("max_new_tokens must be >= 1")


class InvalidRequest(SpecserveError):
    """A request field is invalid; the message starts with the field name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def _tree(req: gateway_pb2.GenerateRequest, draft_name: str | None) -> TreeSpec | None:
    """The TreeSpec of a tree request, with defaults filled in; None for a chain."""
    for field in ("tree_nodes", "tree_top_k", "tree_depth"):
        if getattr(req, field) < 0:
            raise InvalidRequest(field, f"must be >= 0, got {getattr(req, field)}")
    if req.tree_nodes == 0:
        if req.tree_top_k or req.tree_depth:
            raise InvalidRequest("tree_nodes", "must be > 0 when tree_top_k or tree_depth is set")
        return None
    for field, most in (("tree_nodes", MAX_K), ("tree_top_k", MAX_TREE_TOP_K), ("tree_depth", MAX_TREE_DEPTH)):
        if getattr(req, field) > most:
            raise InvalidRequest(field, f"must be in [0, {most}], got {getattr(req, field)}")
    if draft_name is None:
        raise InvalidRequest("tree_nodes", "a tree needs a draft (draft is 'none')")
    return TreeSpec(req.tree_nodes, req.tree_top_k or DEFAULT_TREE_TOP_K, req.tree_depth or DEFAULT_TREE_DEPTH)


def max_token_bytes(tokenizer) -> int:
    """The most bytes of prompt text one token can stand for, bounded from above: the UTF-8 length of the
    tokenizer's longest vocabulary entry (a byte-level entry spells each byte with one character of at
    most two bytes), times 4 for normalizers that shrink text (NFKC folds a ligature into its letters)."""
    longest = max((len(entry.encode("utf-8")) for entry in tokenizer.get_vocab()), default=1)
    return 4 * max(longest, 1)


def utf8_size(text: str) -> int:
    """``len(text.encode("utf-8", "surrogatepass"))``, without the copy for an ASCII text (its bytes are its
    characters; ``isascii`` reads a flag of the string)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_prompt_bytes(text: str, target: target_pb2.TargetInfo, limits: RequestLimits, bytes_per_token: int) -> None:
    """Before tokenizing: a text whose bytes cannot fit in the prompt limit's tokens is refused at once,
    so no prompt's size costs the gateway more than tokenizing what could be a valid prompt. A character is
    1 to 4 bytes of UTF-8, so a text within a quarter of the limit in characters is not even measured."""
    tokens = limits.max_prompt_tokens or target.max_context
    if 4 * len(text) <= tokens * bytes_per_token:
        return
    size = utf8_size(text)
    if size > tokens * bytes_per_token:
        limit = "(--max-prompt-tokens)" if limits.max_prompt_tokens else "(the model's context)"
        raise InvalidRequest(
            "prompt",
            f"{size} bytes of text cannot fit in {tokens} tokens {limit}: a token of "
            f"this tokenizer stands for at most {bytes_per_token} bytes",
        )


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
    """The prompt's token ids (``encode_batch``: unlike ``encode``, it releases the GIL while it runs,
    so on a thread it leaves the event loop running)."""
    return tuple(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def validate_request(
    req: gateway_pb2.GenerateRequest,
    target: target_pb2.TargetInfo,
    drafts: Container[str],
    default_draft: str | None,
    tokenizer=None,
    limits: RequestLimits | None = None,
    encoded: tuple[int, ...] | None = None,
    prompt: str | None = None,
) -> GenerationRequest:
    """Raise InvalidRequest for the first bad field; return the request in engine terms. ``encoded``: the
    text prompt's ids, tokenized already (off the event loop); else the prompt is tokenized here. ``prompt``:
    ``req.prompt`` as the caller read it (None: read here); each read of a protobuf string field decodes its
    bytes into a new string (a few ms for megabytes), so it is read once."""
    limits = limits or RequestLimits()
    prompt = req.prompt if prompt is None else prompt
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidRequest(
            "stop", f"{len(req.stop)} stop strings exceed the limit of {limits.max_stop_strings} (--max-stop-strings)"
        )
    for i, text in enumerate(req.stop):
        if len(text) > limits.max_stop_length:
            raise InvalidRequest(
                f"stop[{i}]", f"{len(text)} characters exceed the limit of {limits.max_stop_length} (--max-stop-length)"
            )
    if limits.max_prompt_tokens and len(req.prompt_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            "prompt_ids",
            f"{len(req.prompt_ids)} tokens exceed the limit of {limits.max_prompt_tokens} (--max-prompt-tokens)",
        )
    if prompt and req.prompt_ids:
        raise InvalidRequest("prompt", "give either prompt (text) or prompt_ids, not both")
    if req.prompt_ids:
        ids = tuple(int(t) for t in req.prompt_ids)
        bad = [t for t in ids if not 0 <= t < target.vocab_size]
        if bad:
            raise InvalidRequest("prompt_ids", f"ids {bad[:4]} outside the vocabulary [0, {target.vocab_size})")
    elif prompt:
        if tokenizer is None:
            raise InvalidRequest("prompt", "this gateway has no tokenizer; send prompt_ids")
        ids = encoded if encoded is not None else encode_text(tokenizer, prompt)
        if not ids:
            raise InvalidRequest("prompt", "encodes to no tokens")
    else:
        raise InvalidRequest("prompt", "empty (set prompt or prompt_ids)")
    if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            "prompt", f"{len(ids)} tokens exceed the limit of {limits.max_prompt_tokens} (--max-prompt-tokens)"
        )
    if len(ids) >= target.max_context:
        raise InvalidRequest("prompt", f"{len(ids)} tokens leave no room in the context of {target.max_context}")

    if req.max_new_tokens <= 0:
        raise InvalidRequest("max_new_tokens", f"must be positive, got {req.max_new_tokens}")
    if req.max_new_tokens > limits.max_new_tokens:
        raise InvalidRequest(
            "max_new_tokens",
            f"{req.max_new_tokens} exceeds the limit of {limits.max_new_tokens} (--max-output-tokens)",
        )
    if len(ids) + req.max_new_tokens > target.max_context:
        raise InvalidRequest(
            "max_new_tokens",
            f"{req.max_new_tokens} new tokens after a {len(ids)}-token prompt exceed the model's context "
            f"of {target.max_context}",
        )

    try:  # the contract's one check (SamplingParams), on the wire's reading (top_p 0 = unset): protos/convert.py
        sampling = convert.sampling_params(req.sampling)
    except BadSampling as exc:
        raise InvalidRequest(f"sampling.{exc.field}", str(exc).removeprefix(f"{exc.field}: ")) from None

    if req.draft == NO_DRAFT:
        draft_name = None
    elif req.draft:
        if req.draft not in drafts:
            raise InvalidRequest("draft", f"unknown draft {req.draft!r}")
        draft_name = req.draft
    else:
        draft_name = default_draft if default_draft in drafts else None

    if req.speculation not in gateway_pb2.Speculation.values():
        raise InvalidRequest("speculation", f"unknown value {req.speculation}")
    if not 0 <= req.num_speculative_tokens <= MAX_K:
        raise InvalidRequest("num_speculative_tokens", f"must be in [0, {MAX_K}], got {req.num_speculative_tokens}")
    try:
        logprobs = convert.logprobs_spec_from_proto(req)
    except convert.ConversionError as exc:
        raise InvalidRequest("logprobs.top", str(exc).removeprefix("logprobs: ")) from None
    return GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=req.max_new_tokens,
        sampling=sampling,
        draft_name=draft_name,
        num_speculative_tokens=req.num_speculative_tokens,
        stop=tuple(req.stop),
        adaptive=req.speculation == gateway_pb2.SPECULATION_ADAPTIVE,
        draft_ahead=req.draft_ahead,
        tree=_tree(req, draft_name),
        logprobs=logprobs,
    )
