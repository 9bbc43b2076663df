"""Helpers shared by the kernel tests: relative error, allocator poisoning, random routing and trees."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN (an unwritten poisoned element) never passes a < check."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


def poison_cuda_allocator(nbytes: int = 512 << 20) -> None:
    """Fill cached device memory with NaN and free it, so outputs the kernels forget to write read NaN."""
    if HAS_CUDA:
        torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))
        torch.cuda.synchronize()


def random_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, device: str):
    """Distinct top-k experts per token from random logits; renormalized softmax weights (fp32)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids.contiguous(), (weights / weights.sum(-1, keepdim=True)).contiguous()


def random_moe_weights(e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator, device: str):
    """w13 [E, 2I, H] and w2 [E, H, I] scaled so activations stay O(1)."""
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    w13 = (torch.randn(e, 2 * i, h, generator=dev_gen, device=device) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=dev_gen, device=device) / i**0.5).to(dtype)
    return w13, w2


def random_tree_mask(q: int, gen: torch.Generator) -> torch.Tensor:  # [q, q] bool
    """Ancestor-or-self mask of a random tree whose nodes are numbered in topological order."""
    mask = torch.eye(q, dtype=torch.bool)
    for j in range(1, q):
        parent = int(torch.randint(0, j, (1,), generator=gen))
        mask[j] |= mask[parent]
    return mask


def random_block_tables(kv_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator):
    """Disjoint random physical blocks per request (plus one spare block each, to test unused entries)."""
    need = [-(-n // block_size) + 1 for n in kv_lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(need) <= num_blocks, "test cache too small"
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    return tables
