"""Metadata of one attention step over a paged KV cache, in the CSR form FlashInfer plans from.

Request b has `query_lens[b]` new tokens whose K/V are already written to the cache right after its
`context_lens[b]` cached tokens, so it sees kv_len = context + new tokens through its block table. New token j
sees every cached token plus new tokens j' with tree_masks[b][j, j'] (None = causal: j' <= j).
Host (CPU) int32 tensors: FlashInfer's plan() reads them on the host anyway; the wrappers copy what the kernels need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specserve.kernels.checks import KernelArgumentError


@dataclass(frozen=True)
class PagedBatch:
    block_size: int
    query_lens: tuple[int, ...]  # [B] new tokens per request (>= 1)
    context_lens: tuple[int, ...]  # [B] cached tokens before this step
    qo_indptr: torch.Tensor  # [B+1] int32 rows of each request in q / out
    kv_indptr: torch.Tensor  # [B+1] int32 ranges into kv_indices
    kv_indices: torch.Tensor  # [nnz] int32 physical block ids, ceil(kv_len / block_size) per request
    kv_lens: torch.Tensor  # [B] int32 context + new tokens
    tree_masks: tuple[torch.Tensor | None, ...]  # [B] bool [q, q] or None (causal)

    def __post_init__(self) -> None:
        b = len(self.query_lens)
        if self.block_size < 1:
            raise KernelArgumentError(f"block_size must be >= 1, got {self.block_size}")
        if b == 0:
            raise KernelArgumentError("a PagedBatch needs at least one request")
        if len(self.context_lens) != b or len(self.tree_masks) != b:
            raise KernelArgumentError(
                f"query_lens ({b}), context_lens ({len(self.context_lens)}) and tree_masks "
                f"({len(self.tree_masks)}) must have one entry per request"
            )
        for name, t, n in (
            ("qo_indptr", self.qo_indptr, b + 1),
            ("kv_indptr", self.kv_indptr, b + 1),
            ("kv_lens", self.kv_lens, b),
        ):
            if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != n or t.device.type != "cpu":
                raise KernelArgumentError(f"{name} must be a CPU int32 vector of {n}, got {t.dtype} {tuple(t.shape)}")
        if any(q < 1 for q in self.query_lens):
            raise KernelArgumentError(f"every request needs >= 1 new token (drop empty ones), got {self.query_lens}")
        if any(c < 0 for c in self.context_lens):
            raise KernelArgumentError(f"context_lens must be >= 0, got {self.context_lens}")
        for i, (m, q) in enumerate(zip(self.tree_masks, self.query_lens)):
            if m is None:
                continue
            if m.dtype != torch.bool or tuple(m.shape) != (q, q):
                raise KernelArgumentError(f"tree_masks[{i}] must be bool [{q}, {q}], got {m.dtype} {tuple(m.shape)}")
            if not bool(m.diagonal().all()):
                raise KernelArgumentError(f"tree_masks[{i}] must let every new token attend to itself")

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        tree_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> PagedBatch:
        """From per-request lengths and block tables (a table may hold spare blocks past kv_len)."""
        b = len(query_lens)
        if len(block_tables) != b:
            raise KernelArgumentError(f"{len(block_tables)} block tables for {b} requests")
        if block_size < 1:
            raise KernelArgumentError(f"block_size must be >= 1, got {block_size}")
        indices: list[int] = []
        kv_indptr, kv_lens = [0], []
        for i, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            kv = int(q) + int(c)
            need = -(-kv // block_size)
            if need > len(table):
                raise KernelArgumentError(
                    f"request {i}: kv_len {kv} needs {need} blocks of {block_size}, block table has {len(table)}"
                )
            if any(int(x) < 0 for x in table[:need]):
                raise KernelArgumentError(f"request {i}: negative block id in {list(table[:need])}")
            indices.extend(int(x) for x in table[:need])
            kv_indptr.append(len(indices))
            kv_lens.append(kv)
        qo = [0]
        for q in query_lens:
            qo.append(qo[-1] + int(q))
        masks = tuple(m.cpu() if m is not None else None for m in tree_masks) if tree_masks is not None else (None,) * b
        return cls(
            block_size=int(block_size),
            query_lens=tuple(int(q) for q in query_lens),
            context_lens=tuple(int(c) for c in context_lens),
            qo_indptr=torch.tensor(qo, dtype=torch.int32),
            kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32),
            kv_indices=torch.tensor(indices, dtype=torch.int32),
            kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
            tree_masks=masks,
        )

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def has_tree(self) -> bool:
        return any(m is not None for m in self.tree_masks)

    def last_page_lens(self) -> torch.Tensor:  # [B] int32
        """Tokens in each request's last block (1..block_size)."""
        pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return (self.kv_lens - (pages - 1) * self.block_size).to(torch.int32)

    def request_mask(self, b: int) -> torch.Tensor:  # [q, kv_len] bool
        """Which of request b's kv_len tokens (cached then new) each of its new tokens sees."""
        q, c = self.query_lens[b], self.context_lens[b]
        own = self.tree_masks[b]
        if own is None:
            own = torch.ones(q, q, dtype=torch.bool).tril()
        return torch.cat([torch.ones(q, c, dtype=torch.bool), own], dim=1)

    def token_slots(self, b: int) -> torch.Tensor:  # [kv_len] int64
        """Flat cache slots (block * block_size + offset) of request b's kv_len tokens, in order."""
        blocks = self.kv_indices[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])].long()
        pos = torch.arange(int(self.kv_lens[b]))
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def check_blocks_fit(self, num_blocks: int, name: str) -> None:
        """Every block id must address the cache tensor `name` with num_blocks blocks."""
        if self.kv_indices.numel() and int(self.kv_indices.max()) >= num_blocks:
            raise KernelArgumentError(
                f"block id {int(self.kv_indices.max())} out of range for {name} with {num_blocks} blocks"
            )
