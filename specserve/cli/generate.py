"""`specserve generate`: target, drafter and the per-request loop in one process."""

from __future__ import annotations

import argparse
import sys

from specserve.cli.common import (
    add_model_arguments,
    add_prompt_arguments,
    add_threads_argument,
    apply_threads,
    result_json,
    sampling_from_args,
    speculative_tokens,
    tree_from_args,
)
from specserve.contract.speculation import DEFAULT_K
from specserve.errors import SpecserveError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_prompt_arguments(parser)
    add_threads_argument(parser)


def prompt_ids_from_args(args: argparse.Namespace, tokenizer) -> tuple[int, ...]:
    if args.prompt_ids is not None:
        return tuple(args.prompt_ids)
    if tokenizer is None:
        raise SpecserveError("--prompt needs a checkpoint with tokenizer.json; use --prompt-ids instead")
    ids = tuple(tokenizer.encode(args.prompt).ids)
    if not ids:
        raise SpecserveError("--prompt encodes to no tokens")
    return ids


def build_local(args: argparse.Namespace):
    """(engine, proposer or None) from the model flags."""
    from specserve.cli.common import drafter_config_from_args, engine_config_from_args
    from specserve.draft_service.registry import build_proposer
    from specserve.target_service.factory import build_engine

    engine_config = engine_config_from_args(args)
    model = engine_config.model
    engine = build_engine(engine_config)
    proposer = None
    if args.draft != "none":
        proposer = build_proposer(drafter_config_from_args(args, target_checkpoint=model))
        target_hash, draft_hash = engine.info().vocab_hash, proposer.info.vocab_hash
        if draft_hash and target_hash != draft_hash:
            raise SpecserveError(f"drafter vocabulary {draft_hash[:12]} does not match the target's {target_hash[:12]}")
        if proposer.info.needs_hidden_states:
            engine.add_graph_layers(proposer.info.hidden_layers)
    return engine, proposer


async def _generate(args: argparse.Namespace) -> dict:
    from specserve.contract.types import GenerationRequest
    from specserve.loop.adaptive import AdaptiveConfig, AdaptiveSpeculation
    from specserve.loop.engine_thread import EngineThread
    from specserve.loop.local import LocalDraft
    from specserve.loop.step_loop import FinalEvent

    k = speculative_tokens(args, "generate") or DEFAULT_K
    tree = tree_from_args(args)
    engine, proposer = build_local(args)
    if tree is not None and (proposer is None or not proposer.info.supports_tree):
        raise SpecserveError(
            f"--tree-nodes needs a drafter that drafts trees (model, eagle3), not --draft {args.draft}"
        )
    tokenizer = getattr(engine, "tokenizer", None)
    prompt_ids = prompt_ids_from_args(args, tokenizer)
    context = engine.info().max_context
    if len(prompt_ids) + args.max_new_tokens > context:  # refused up front, as the gateway refuses it
        raise SpecserveError(
            f"--max-new-tokens: {args.max_new_tokens} new tokens after a {len(prompt_ids)}-token "
            f"prompt exceed the model's context of {context}"
        )
    request = GenerationRequest(
        prompt_ids=prompt_ids,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling_from_args(args),
        num_speculative_tokens=k,
        tree=tree,
        stop=tuple(args.stop),
        adaptive=args.speculation == "adaptive",
        draft_ahead=args.draft_ahead == "on",
    )
    target = EngineThread(engine)  # the step loop runs on the engine's thread
    draft = LocalDraft(proposer) if proposer is not None else None
    final = None
    try:
        adaptive = AdaptiveSpeculation(AdaptiveConfig(max_k=max(1, k)))
        async for event in target.generate(request, draft, tokenizer=tokenizer, adaptive=adaptive):
            if isinstance(event, FinalEvent):
                final = event  # the last event; the generator then closes on its own
            elif not args.json and event.text:
                print(event.text, end="", flush=True)
    finally:
        target.close()
        if draft is not None:
            draft.close()
    return {
        "token_ids": final.token_ids,
        "text": final.text,
        "finish_reason": final.finish_reason,
        "stats": final.stats.as_dict(),
    }


def run(args: argparse.Namespace) -> int:
    import uvloop

    apply_threads(args.threads)

    out = uvloop.run(_generate(args))
    if args.json:
        print(result_json(out["token_ids"], out["text"], out["finish_reason"], out["stats"]))
    else:
        stats = out["stats"]
        if out["text"] is None:
            print(",".join(map(str, out["token_ids"])))
        else:
            print()
        print(
            f"[{len(out['token_ids'])} tokens, {stats['tokens_per_s']:.1f} tok/s, "
            f"mean accepted length {stats['mean_accepted_length']:.2f}, finish {out['finish_reason']}]",
            file=sys.stderr,
        )
    return 0
