"""Row metadata of one paged-attention step as static-shaped device tensors (the CUDA-graph form of PagedBatch).

Vocabulary: a *row* is one query token (decode: one per request; verify: one per draft-tree node). Row i belongs
to request b = row_request[i] (-1 = a padding row, whose output is zeros) and is new token j = row_index[i] of
that request. Request b sees kv_lens[b] tokens through block_tables[b] (cached tokens, then its new tokens, whose
K/V are already written); its new tokens start at kv index new_starts[b]. Row i sees every kv index s < new_start
plus new token t = s - new_start where tree_mask[i, t] (tree verify), else where t <= j (causal among new tokens).

With tree_paths (token-count invariant tree steps) row i instead sees the cached indices plus new tokens
tree_paths[i, 0..row_index[i]] (its path from the request's first new token, in depth order; row_index is then its
depth), read at consecutive kv positions new_start + t, so each row sees its keys where a one-token decode of its
path would (kernels/paged_attention_triton.py `_source`).

Shapes are static maxima (B requests, N rows, max_blocks per table, max_new new tokens per request), so a graph
captured over them stays valid when a later step writes other lengths and block ids into the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.checks import KernelArgumentError, check_dim, check_same_device, check_tensor, require
from specserve.kernels.paged_batch import PagedBatch


@dataclass(frozen=True)
class PagedRows:
    block_tables: torch.Tensor  # [B, max_blocks] int32 physical block ids (entries past a request's blocks: any)
    kv_lens: torch.Tensor  # [B] int32 tokens visible to the request, its new ones included (0 = unused request)
    new_starts: torch.Tensor  # [B] int32 kv index of the request's first new token
    row_request: torch.Tensor  # [N] int32 request of each row; -1 = padding row (output zeros)
    row_index: torch.Tensor  # [N] int32 the row's index among its request's new tokens
    tree_mask: torch.Tensor | None = None  # [N, max_new] bool: row i may see new token t; None = causal
    tree_paths: torch.Tensor | None = None  # [N, max_new] int32: row i's path of new tokens (not with tree_mask)

    def __post_init__(self) -> None:
        i32 = (torch.int32,)
        check_tensor("block_tables", self.block_tables, 2, i32)
        check_tensor("kv_lens", self.kv_lens, 1, i32)
        check_tensor("new_starts", self.new_starts, 1, i32)
        check_tensor("row_request", self.row_request, 1, i32)
        check_tensor("row_index", self.row_index, 1, i32)
        b = self.block_tables.shape[0]
        require(
            b >= 1 and self.block_tables.shape[1] >= 1,
            f"block_tables must be [B >= 1, max_blocks >= 1], got {tuple(self.block_tables.shape)}",
        )
        check_dim("kv_lens", self.kv_lens, 0, b, "the number of requests B = block_tables.shape[0]")
        check_dim("new_starts", self.new_starts, 0, b, "the number of requests B = block_tables.shape[0]")
        n = self.row_request.shape[0]
        require(n >= 1, "row_request must hold at least one row")
        check_dim("row_index", self.row_index, 0, n, "the number of rows N = row_request.shape[0]")
        named = [
            ("block_tables", self.block_tables),
            ("kv_lens", self.kv_lens),
            ("new_starts", self.new_starts),
            ("row_request", self.row_request),
            ("row_index", self.row_index),
        ]
        if self.tree_mask is not None:
            check_tensor("tree_mask", self.tree_mask, 2, (torch.bool,))
            check_dim("tree_mask", self.tree_mask, 0, n, "the number of rows N = row_request.shape[0]")
            require(self.tree_mask.shape[1] >= 1, "tree_mask needs at least one column")
            named.append(("tree_mask", self.tree_mask))
        if self.tree_paths is not None:
            require(self.tree_mask is None, "tree_paths and tree_mask are two forms of a tree: give one")
            check_tensor("tree_paths", self.tree_paths, 2, i32)
            check_dim("tree_paths", self.tree_paths, 0, n, "the number of rows N = row_request.shape[0]")
            require(self.tree_paths.shape[1] >= 1, "tree_paths needs at least one column")
            named.append(("tree_paths", self.tree_paths))
        check_same_device(named)

    @property
    def num_requests(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_rows(self) -> int:
        return self.row_request.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    @property
    def device(self) -> torch.device:
        return self.row_request.device

    def visible(self, row: int, block_size: int) -> torch.Tensor:  # [kv_len] bool (host; for references and tests)
        """Which kv indices of its request row `row` sees (empty for a padding row)."""
        b = int(self.row_request[row])
        if b < 0 or b >= self.num_requests:
            return torch.zeros(0, dtype=torch.bool)
        kv_len = min(int(self.kv_lens[b]), self.max_blocks * block_size)
        t = torch.arange(kv_len) - int(self.new_starts[b])
        if self.tree_paths is not None:  # its path's nodes, wherever they sit among the new tokens
            path = self.tree_paths[row].cpu().long()[: int(self.row_index[row]) + 1]
            new_ok = torch.zeros(kv_len, dtype=torch.bool)
            inside = (t >= 0) & (t < kv_len)
            new_ok[inside] = torch.isin(t[inside], path)
        elif self.tree_mask is None:
            new_ok = t <= int(self.row_index[row])
        else:
            width = self.tree_mask.shape[1]
            cols = self.tree_mask[row].cpu()
            new_ok = torch.zeros(kv_len, dtype=torch.bool)
            inside = (t >= 0) & (t < width)
            new_ok[inside] = cols[t[inside]]
        return (t < 0) | new_ok

    def slots(self, row: int, block_size: int) -> torch.Tensor:  # [kv_len] int64 flat cache slots (host)
        """Flat cache slots (block * block_size + offset) of the kv indices of row `row`'s request."""
        b = int(self.row_request[row])
        if b < 0 or b >= self.num_requests:
            return torch.zeros(0, dtype=torch.int64)
        kv_len = min(int(self.kv_lens[b]), self.max_blocks * block_size)
        pos = torch.arange(kv_len)
        return self.block_tables[b].cpu().long()[pos // block_size] * block_size + pos % block_size

    def validate(self, num_blocks: int, block_size: int) -> None:
        """Value checks (host syncs: debug and test paths only, never inside a captured step)."""
        bt, kv, ns = self.block_tables.cpu(), self.kv_lens.cpu(), self.new_starts.cpu()
        rr, ri = self.row_request.cpu(), self.row_index.cpu()
        cap = self.max_blocks * block_size
        for b in range(self.num_requests):
            n, s = int(kv[b]), int(ns[b])
            require(0 <= n <= cap, f"kv_lens[{b}] = {n} outside [0, max_blocks * block_size = {cap}]")
            require(0 <= s <= n, f"new_starts[{b}] = {s} outside [0, kv_lens[{b}] = {n}]")
            need = bt[b, : -(-n // block_size)]
            if need.numel():
                lo, hi = int(need.min()), int(need.max())
                require(
                    lo >= 0 and hi < num_blocks,
                    f"block_tables[{b}] holds block ids in [{lo}, {hi}], cache has {num_blocks} blocks",
                )
        for i in range(self.num_rows):
            b = int(rr[i])
            require(-1 <= b < self.num_requests, f"row_request[{i}] = {b} outside [-1, {self.num_requests})")
            if b < 0 or int(kv[b]) == 0:  # the two forms of a padding row
                continue
            j = int(ri[i])
            require(
                j >= 0 and int(ns[b]) + j < int(kv[b]),
                f"row {i}: new token {j} of request {b} is not among its kv_lens - new_starts new tokens",
            )
            if self.tree_mask is not None:
                require(j < self.tree_mask.shape[1], f"row_index[{i}] = {j} >= tree_mask width")

    @classmethod
    def from_batch(
        cls,
        batch: PagedBatch,
        device: torch.device | str,
        num_rows: int | None = None,
        num_requests: int | None = None,
        max_blocks: int | None = None,
        max_new: int | None = None,
        tree: bool | None = None,
    ) -> PagedRows:
        """Padded device tensors from a host PagedBatch (rows in request order; extra rows/requests are padding).

        tree=None: a tree mask iff the batch has one; True forces one (causal requests get their causal rows)."""
        b, n = batch.num_requests, batch.num_tokens
        nb = [int(batch.kv_indptr[i + 1] - batch.kv_indptr[i]) for i in range(b)]
        num_rows = n if num_rows is None else num_rows
        num_requests = b if num_requests is None else num_requests
        max_blocks = max(max(nb), 1) if max_blocks is None else max_blocks
        max_new = max(batch.query_lens) if max_new is None else max_new
        require(
            num_rows >= n and num_requests >= b and max_blocks >= max(nb) and max_new >= max(batch.query_lens),
            f"padded sizes (rows {num_rows}, requests {num_requests}, blocks {max_blocks}, new {max_new}) are "
            f"below the batch's ({n}, {b}, {max(nb)}, {max(batch.query_lens)})",
        )
        tables = torch.zeros(num_requests, max_blocks, dtype=torch.int32)
        kv_lens = torch.zeros(num_requests, dtype=torch.int32)
        starts = torch.zeros(num_requests, dtype=torch.int32)
        row_req = torch.full((num_rows,), -1, dtype=torch.int32)
        row_idx = torch.zeros(num_rows, dtype=torch.int32)
        use_tree = batch.has_tree if tree is None else tree
        mask = torch.zeros(num_rows, max_new, dtype=torch.bool) if use_tree else None
        for i in range(b):
            tables[i, : nb[i]] = batch.kv_indices[int(batch.kv_indptr[i]) : int(batch.kv_indptr[i + 1])]
            kv_lens[i] = batch.kv_lens[i]
            starts[i] = batch.context_lens[i]
            s, q = int(batch.qo_indptr[i]), batch.query_lens[i]
            row_req[s : s + q] = i
            row_idx[s : s + q] = torch.arange(q, dtype=torch.int32)
            if mask is not None:
                own = batch.tree_masks[i]
                mask[s : s + q, :q] = own if own is not None else torch.ones(q, q, dtype=torch.bool).tril()
        dev = torch.device(device)
        return cls(
            tables.to(dev),
            kv_lens.to(dev),
            starts.to(dev),
            row_req.to(dev),
            row_idx.to(dev),
            None if mask is None else mask.to(dev),
        )

    def with_paths(self) -> PagedRows:
        """The same rows in the tree_paths form (token-count invariant steps; causal rows get their chains)."""
        mask = self.tree_mask.cpu() if self.tree_mask is not None else None
        if mask is None:
            idx = self.row_index.cpu()
            mask = torch.arange(max(1, int(idx.max()) + 1))[None, :] <= idx[:, None]
        paths, depth = tree_paths_of(mask)
        dev = self.device
        return PagedRows(
            self.block_tables,
            self.kv_lens,
            self.new_starts,
            self.row_request,
            depth.clamp(min=0).to(torch.int32).to(dev),
            None,
            paths.to(torch.int32).to(dev),
        )


def tree_paths_of(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, w] bool -> ([n, w], [n]) int64
    """(each row's path: the new tokens it sees in index order, which is depth order since parents come first, then
    zeros; its depth) of tree-mask rows [n, w] (True = may attend) on the host."""
    counts = mask.sum(1)
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # seen columns first, in index order
    paths = torch.where(torch.arange(mask.shape[1])[None, :] < counts[:, None], order, 0)
    return paths, counts - 1


def allocate_rows(
    num_requests: int, num_rows: int, max_blocks: int, max_new: int | None, device: torch.device | str
) -> PagedRows:
    """Static buffers for a captured step: every row padding (-1), every request empty; max_new=None: causal."""
    require(
        min(num_requests, num_rows, max_blocks) >= 1 and (max_new is None or max_new >= 1),
        f"sizes must be >= 1, got {num_requests}, {num_rows}, {max_blocks}, {max_new}",
    )

    def i32(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device=device)

    mask = None if max_new is None else torch.zeros(num_rows, max_new, dtype=torch.bool, device=device)
    return PagedRows(
        i32(num_requests, max_blocks),
        i32(num_requests),
        i32(num_requests),
        torch.full((num_rows,), -1, dtype=torch.int32, device=device),
        i32(num_rows),
        mask,
    )


def write_rows_(rows: PagedRows, batch: PagedBatch) -> None:
    """Fill static buffers (from allocate_rows) with a host batch: one host build, one copy per field, no
    allocation on the device; the batch must fit the buffers' sizes (KernelArgumentError otherwise)."""
    require(rows.tree_mask is not None or not batch.has_tree, "the batch has a tree mask but the buffers are causal")
    src = PagedRows.from_batch(
        batch,
        "cpu",
        num_rows=rows.num_rows,
        num_requests=rows.num_requests,
        max_blocks=rows.max_blocks,
        max_new=rows.tree_mask.shape[1] if rows.tree_mask is not None else None,
        tree=rows.tree_mask is not None,
    )
    for name in ("block_tables", "kv_lens", "new_starts", "row_request", "row_index", "tree_mask"):
        dst = getattr(rows, name)
        if dst is not None:
            dst.copy_(getattr(src, name), non_blocking=True)


def check_rows_match(rows: PagedRows, name: str, t: torch.Tensor) -> None:
    """t must have one entry per row on the rows' device."""
    check_dim(name, t, 0, rows.num_rows, "the number of rows N = row_request.shape[0]")
    if t.device != rows.device:
        raise KernelArgumentError(f"{name} is on {t.device} but the row metadata is on {rows.device}")
