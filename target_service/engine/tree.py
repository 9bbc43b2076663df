"""Verify-step token layout for chains and trees (terms as in the glossary of ``specserve/contract/types.py``).

A verify step feeds ``n + 1`` tokens: node 0 is the pending token, node ``i + 1`` is drafted token ``i``
of the :class:`DraftBlock`. In node indexing, ``parents[0] == -1`` and ``parents[j] < j`` for every
other node. Node ``j`` sits at logical position ``context_len + depth[j]`` (depth of the pending token
is 0) but is written to the cache at the step-local offset ``j`` (slot of position ``context_len + j``).
After acceptance the accepted root-to-node path ``[0, a1, ..., am]`` is moved to offsets ``0..m``
(contiguous positions), and everything after offset ``m`` is dropped by truncation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.contract.types import DraftBlock


@dataclass(frozen=True)
class StepLayout:
    """Node-indexed structure of one verify step (node 0 = pending token)."""

    parents: tuple[int, ...]  # [n+1]; parents[0] = -1
    depth: tuple[int, ...]  # [n+1]; depth[0] = 0
    children: tuple[tuple[int, ...], ...]  # [n+1] child node ids in ascending order
    is_chain: bool

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("node 0 (pending token) must be the root with parent -1")
        for j in range(1, len(self.parents)):
            if not 0 <= self.parents[j] < j:
                raise ValueError(f"node {j} has parent {self.parents[j]}, must be in [0, {j})")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def path_to(self, node: int) -> tuple[int, ...]:
        """Root-to-node path, both ends included: ``(0, ..., node)``."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} outside [0, {self.num_nodes})")
        path = [node]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        return tuple(reversed(path))

    def positions(self, context_len: int) -> list[int]:
        """Logical positions of the nodes: ``context_len + depth``."""
        return [context_len + d for d in self.depth]

    def attention_mask(self) -> torch.Tensor:  # [n+1, n+1] bool
        """``mask[i, j]`` is True when node i may attend to node j (j is i itself or an ancestor)."""
        n1 = self.num_nodes
        mask = torch.zeros(n1, n1, dtype=torch.bool)
        for i in range(n1):
            j = i
            while j != -1:
                mask[i, j] = True
                j = self.parents[j]
        return mask


def layout_of(block: DraftBlock) -> StepLayout:
    """Layout of ``[pending] + block``; a chain is the tree where node j's parent is j - 1."""
    n = len(block)
    if block.parents is None:
        parents = tuple(range(-1, n))
    else:
        parents = (-1,) + tuple(p + 1 for p in block.parents)
    depth = [0] * (n + 1)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for j in range(1, n + 1):
        depth[j] = depth[parents[j]] + 1
        children[parents[j]].append(j)
    is_chain = all(parents[j] == j - 1 for j in range(1, n + 1))
    return StepLayout(
        parents=parents,
        depth=tuple(depth),
        children=tuple(tuple(c) for c in children),
        is_chain=is_chain,
    )


def compaction_moves(path: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Step-local offsets (src, dst) that move an accepted path to offsets 0..len(path)-1.

    Node ``path[k]`` was written at offset ``path[k] >= k`` and must end at offset ``k``. Every source
    of a later move lies beyond every earlier destination, so the moves are correct applied in list
    order or as one gather-then-scatter (read all sources, then write), not as unordered parallel
    read-writes (a destination may be the source of an earlier move).
    """
    src, dst = [], []
    for k, node in enumerate(path):
        if node != k:
            src.append(node)
            dst.append(k)
    return src, dst
