"""The checks of token-count invariant target steps (issue #31), shared by the CPU and GPU tests: a verify of
k + 1 tokens against k + 1 one-token decodes, and a tree's nodes against their paths verified as chains."""

from __future__ import annotations

import torch

from specserve.contract.types import DraftBlock
from specserve.target_service.factory import EngineConfig, build_engine

K_MAX = 15
TREE_TOKENS = 3  # parents of the tree built from the greedy continuation (and siblings off it)


def engine_for(model: str, dtype: str, invariant: bool, device: str = "cpu"):
    return build_engine(
        EngineConfig(
            model=model, dtype=dtype, device=device, num_kv_blocks=64, invariant_steps=invariant, max_context=512
        )
    )


def decode_logits(engine, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """(the greedy continuation: pending token then `steps` more, the logits [V] of each one-token decode)."""
    engine.prefill("decodes", prompt)
    tokens, rows = [engine.session("decodes").pending_token], []
    for _ in range(steps):
        rows.append(engine.score_block("decodes", DraftBlock(token_ids=())).clone()[0])
        tokens.append(engine.decode("decodes").next_token)
    engine.release("decodes")
    return tokens, rows


def chain_mismatches(engine, prompt: list[int]) -> list[tuple[int, int]]:
    """(k, row) of every verify row of k = 0..K_MAX drafted tokens that differs from its one-token decode."""
    tokens, decodes = decode_logits(engine, prompt, K_MAX + 1)
    engine.prefill("verify", prompt)
    bad = []
    for k in range(K_MAX + 1):
        logits = engine.score_block("verify", DraftBlock(token_ids=tuple(tokens[1 : 1 + k])))
        bad += [(k, j) for j in range(k + 1) if not torch.equal(logits[j], decodes[j])]
    engine.release("verify")
    return bad


def tree_mismatches(engine, prompt: list[int]) -> list[int]:
    """Nodes of a tree (the greedy path with a sibling off each node of it) whose logits differ from those of their
    path verified as a chain (itself equal to its decodes: chain_mismatches)."""
    tokens, _ = decode_logits(engine, prompt, TREE_TOKENS + 1)
    ids, parents = [], []
    for depth in range(TREE_TOKENS):  # node 2d: on the path; node 2d + 1: its sibling, off it
        parent = 2 * depth - 2 if depth else -1
        ids += [tokens[1 + depth], (tokens[1 + depth] + 1) % 200]
        parents += [parent, parent]
    engine.prefill("tree", prompt)
    tree = engine.score_block("tree", DraftBlock(token_ids=tuple(ids), parents=tuple(parents))).clone()
    bad = []
    for node in range(len(ids)):
        path, i = [], node
        while i >= 0:
            path.insert(0, ids[i])
            i = parents[i]
        chain = engine.score_block("tree", DraftBlock(token_ids=tuple(path)))
        if not torch.equal(tree[node + 1], chain[-1]):
            bad.append(node)
    if not torch.equal(tree[0], chain[0]):
        bad.append(-1)  # the pending token
    engine.release("tree")
    return bad


def greedy_speculation(engine, prompt: list[int], reference: list[int], k: int) -> list[int]:
    """Greedy speculative decoding whose drafts are `reference` with every third token wrong, through
    engine.verify (a graph step's summary included), until as many tokens as `reference` holds."""
    engine.prefill("spec", prompt)
    out = [engine.session("spec").pending_token]
    while len(out) < len(reference):
        draft = [t if (len(out) + i) % 3 else (t + 1) % 200 for i, t in enumerate(reference[len(out) : len(out) + k])]
        result = engine.verify("spec", DraftBlock(token_ids=tuple(draft)))
        out += [*result.accepted_ids, result.next_token]
    engine.release("spec")
    return out[: len(reference)]
