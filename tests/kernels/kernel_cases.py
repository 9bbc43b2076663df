"""Random cases shared by the new kernels' GPU, interpreter and CPU tests (paged attention rows, norms, routers)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import torch
from kernel_test_utils import poison_cuda_allocator, random_block_tables, random_tree_mask, rel_err

from specserve.kernels.attention_reference import mla_attention_reference, paged_attention_reference
from specserve.kernels.paged_attention import paged_gqa_attention, paged_mla_attention
from specserve.kernels.paged_attention_reference import gqa_rows_reference, mla_rows_reference
from specserve.kernels.paged_batch import PagedBatch
from specserve.kernels.paged_rows import PagedRows
from specserve.kernels.router_reference import RouterConfig


def paged_case(
    q_lens: list[int],
    ctx_lens: list[int],
    block_size: int,
    tree: bool,
    gen: torch.Generator,
    device: str,
    pad_rows: int = 0,
    pad_requests: int = 0,
    max_blocks: int | None = None,
    max_new: int | None = None,
) -> tuple[PagedBatch, PagedRows, int]:
    """(host PagedBatch, padded device PagedRows, num_blocks). Padding rows/requests come after the real ones;
    max_blocks defaults to two spare table entries, max_new to one spare tree-mask column."""
    kv = [q + c for q, c in zip(q_lens, ctx_lens)]
    num_blocks = sum(-(-n // block_size) + 1 for n in kv) + 3
    tables = random_block_tables(kv, block_size, num_blocks, gen)
    masks = [random_tree_mask(q, gen) for q in q_lens] if tree else None
    batch = PagedBatch.build(q_lens, ctx_lens, tables, block_size, masks)
    rows = PagedRows.from_batch(
        batch,
        device,
        num_rows=batch.num_tokens + pad_rows,
        num_requests=batch.num_requests + pad_requests,
        max_blocks=max_blocks or max(len(t) for t in tables) + 2,
        max_new=max_new or max(q_lens) + 1,
    )
    return batch, rows, num_blocks


def randn(
    shape: tuple[int, ...], gen: torch.Generator, device: str, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def nan_like(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    """A NaN-filled output buffer: any element a kernel forgets to write stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def padded_rows(rows, pad_request: int):
    """Point the first padding row at an unused request (kv_len 0): the other padding form."""
    req = rows.row_request.clone()
    pads = (req < 0).nonzero()
    if len(pads):
        req[int(pads[0])] = pad_request
    return dataclasses.replace(rows, row_request=req)


def run_gqa_case(device, shape, q_lens, ctx, block_size, tree, dtype, num_splits, seed, tol=1e-2, block_n=None):
    """One GQA kernel call on NaN-filled out/workspace buffers against both references."""
    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    batch, rows, nb = paged_case(q_lens, ctx, block_size, tree, gen, device, pad_rows=2, pad_requests=1)
    rows = padded_rows(rows, batch.num_requests)
    cache = randn((nb, block_size, 2, hkv, d), gen, device, dtype)
    q = randn((rows.num_rows, hq, d), gen, device, dtype)
    ref = gqa_rows_reference(q, cache, rows, sm_scale=0.3)
    n = batch.num_tokens
    assert rel_err(ref[:n], paged_attention_reference(q[:n], cache, batch, sm_scale=0.3)) < 1e-2
    out = nan_like((rows.num_rows, hq, d), device, dtype)
    ws = nan_like((rows.num_rows * hq * num_splits * (d + 2),), device, torch.float32)
    poison_cuda_allocator()
    got = paged_gqa_attention(
        q, cache, rows, 0.3, out=out, num_splits=num_splits, workspace=ws, validate=True, block_n=block_n
    )
    sync(device)
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(out[:n], ref[:n]) < tol
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"


def run_mla_case(device, shape, q_lens, ctx, block_size, tree, dtype, num_splits, seed, tol=1e-2, block_n=None):
    """One MLA kernel call on NaN-filled out/workspace buffers against both references."""
    h, r, p = shape
    gen = torch.Generator().manual_seed(seed)
    batch, rows, nb = paged_case(q_lens, ctx, block_size, tree, gen, device, pad_rows=1, pad_requests=1)
    rows = padded_rows(rows, batch.num_requests)
    cache = randn((nb, block_size, r + p), gen, device, dtype)
    qn = randn((rows.num_rows, h, r), gen, device, dtype)
    qp = randn((rows.num_rows, h, p), gen, device, dtype)
    scale = (r // 4 + p) ** -0.5
    ref = mla_rows_reference(qn, qp, cache, rows, scale)
    n = batch.num_tokens
    assert rel_err(ref[:n], mla_attention_reference(qn[:n], qp[:n], cache, batch, scale)) < 1e-2
    out = nan_like((rows.num_rows, h, r), device, dtype)
    ws = nan_like((rows.num_rows * h * num_splits * (r + 2),), device, torch.float32)
    poison_cuda_allocator()
    paged_mla_attention(
        qn, qp, cache, rows, scale, out=out, num_splits=num_splits, workspace=ws, validate=True, block_n=block_n
    )
    sync(device)
    assert rel_err(out[:n], ref[:n]) < tol
    assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be zeros"


ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-20}


def assert_close_ulps(
    out: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0, exact_share: float = 0.98, row_scale: bool = False
) -> None:
    """Within `ulps` units in the last place of the io dtype everywhere, and bit-equal in most elements
    (bf16/fp16: the kernels round the same fp32 values as torch; only rsqrt and sum order differ). NaN fails.
    row_scale: ulps of the row's largest element (an input ulp carried through a difference, as in RoPE)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, r = out.double(), ref.double()
    scale = r.abs().amax(dim=-1, keepdim=True) if row_scale else 0.0
    bound = ulps * ULP[ref.dtype] * (r.abs() + scale + 1e-3)
    assert bool(((o - r).abs() <= bound).all()), f"max diff {float((o - r).abs().max())}"
    if ref.dtype != torch.float32:
        share = float((o == r).double().mean())
        assert share >= exact_share, f"only {share:.4f} of elements bit-equal"


def norm_weight(h: int, gen: torch.Generator, device: str, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.3 * torch.randn(h, generator=gen)).to(device=device, dtype=dtype)


def _router_margins_ok(logits: torch.Tensor, bias: torch.Tensor | None, cfg, rel: float = 1e-4) -> torch.Tensor:
    """[T] bool: the row's selection has no near-tie (group cut, top-k cut, order of the top k), in fp64."""
    x = logits.double()
    s = x.sigmoid() if cfg.scoring == "sigmoid" else torch.softmax(x, dim=-1)
    c = s + bias.double() if bias is not None else s
    gap = rel * c.abs().amax(dim=-1)  # [T]
    ok = torch.ones(x.shape[0], dtype=torch.bool)
    if cfg.n_group > 1:
        per = cfg.num_experts // cfg.n_group
        gs = c.view(-1, cfg.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1).sort(dim=-1, descending=True)[0]
        if cfg.topk_group < cfg.n_group:
            ok &= (gs[:, cfg.topk_group - 1] - gs[:, cfg.topk_group]) > gap
        best = c.view(-1, cfg.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1)[1]
        keep = torch.zeros(x.shape[0], cfg.n_group, dtype=torch.bool).scatter_(1, best, True)
        c = c.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    top = c.sort(dim=-1, descending=True)[0][:, : cfg.top_k + 1]
    diffs = top[:, :-1] - top[:, 1:]
    return ok & (torch.nan_to_num(diffs, posinf=1e9) > gap[:, None]).all(dim=-1)


def router_case(
    t: int,
    cfg,
    with_bias: bool,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str,
    scale: float = 2.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [T, E] in dtype, bias [E] fp32 or None) with no near-tie in any row (rows redrawn until so);
    `bias` reuses a given correction bias."""
    if bias is None and with_bias:
        bias = 0.05 * torch.randn(cfg.num_experts, generator=gen)
    bias = None if bias is None else bias.float().cpu()
    logits = (scale * torch.randn(t, cfg.num_experts, generator=gen)).to(dtype)
    for _ in range(100):
        bad = ~_router_margins_ok(logits.float(), bias, cfg)
        if not bool(bad.any()):
            break
        logits[bad] = (scale * torch.randn(int(bad.sum()), cfg.num_experts, generator=gen)).to(dtype)
    else:
        raise AssertionError("could not draw tie-free router logits")
    return logits.to(device), None if bias is None else bias.to(device)


# The routers of public MoE models and odd sizes: name -> (config, with a correction bias).
ROUTERS = MappingProxyType(
    {  # name: (config, with correction bias)
        "qwen3_30b_a3b": (RouterConfig(128, 8, "softmax", norm_topk_prob=True), False),
        "qwen3_moe_no_renorm": (RouterConfig(128, 8, "softmax", norm_topk_prob=False), False),
        "mixtral": (RouterConfig(8, 2, "softmax"), False),
        "qwen2_moe_60": (RouterConfig(60, 6, "softmax", norm_topk_prob=False), False),
        "deepseek_v3": (RouterConfig(256, 8, "sigmoid", 8, 4, True, 2.5), True),
        "kimi_k2": (RouterConfig(384, 8, "sigmoid", 1, 1, True, 2.827), True),
        "demo": (RouterConfig(16, 4, "sigmoid", 4, 2, True, 1.0), True),
        "odd_groups": (RouterConfig(72, 5, "sigmoid", 3, 2, True, 1.5), True),
        "one_expert_groups": (RouterConfig(8, 3, "sigmoid", 8, 4, False, 1.0), False),
        "sigmoid_no_bias": (RouterConfig(64, 6, "sigmoid", 4, 3, True, 1.0), False),
    }
)


def rope_tables(
    max_pos: int, dim: int, dtype: torch.dtype, device: str, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, dim / 2] in dtype, computed as RotaryEmbedding.cos_sin computes them (default rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return freqs.cos().to(device=device, dtype=dtype), freqs.sin().to(device=device, dtype=dtype)


def slots_and_positions(
    t: int, num_slots: int, max_pos: int, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random cache slots (every fourth token -1: not written) and random positions, [T] int64 each."""
    slots = torch.randperm(num_slots, generator=gen)[:t]
    slots[torch.arange(t) % 4 == 3] = -1
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    return slots.to(device), positions.to(device)


def poison_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A copy of cache whose entries at the written slots are NaN (so an unwritten element shows)."""
    out = cache.clone()
    flat = out.view(cache.shape[0] * cache.shape[1], -1)
    flat[slots[slots >= 0]] = float("nan")
    return out


def _compare(out: torch.Tensor, ref: torch.Tensor, exact: bool, loose: bool) -> None:
    """Kernel vs reference. exact: bit-equal (bf16/fp16 RoPE without a norm: the same roundings as torch);
    else within ulps of the row and mostly bit-equal; `loose`: bf16 under the interpreter (truncating casts)."""
    if loose:
        assert_close_ulps(out, ref, ulps=8.0, exact_share=0.0, row_scale=True)
    elif exact:
        assert torch.equal(out, ref)
    else:
        assert_close_ulps(out, ref, row_scale=True)


def run_rope_gqa_case(device, shape, t, dtype, interleaved, qk_norm, seed, loose=False):
    """rope_cache_gqa on strided q/k/v views of one qkv output, NaN q_out and NaN target cache slots."""
    from specserve.kernels.rope_cache import rope_cache_gqa
    from specserve.kernels.rope_cache_reference import rope_cache_gqa_reference

    hq, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    qkv = randn((t, (hq + 2 * hkv) * d), gen, device, dtype, scale=2.0)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    cos, sin = rope_tables(4096, d, dtype, device)
    nb, bs = -(-2 * t // 16) + 1, 16
    slots, positions = slots_and_positions(t, nb * bs, 4096, gen, device)
    qw, kw = (norm_weight(d, gen, device, dtype), norm_weight(d, gen, device, dtype)) if qk_norm else (None, None)
    cache = poison_slots(randn((nb, bs, 2, hkv, d), gen, device, dtype), slots)
    ref_cache = cache.clone()
    ref_q = rope_cache_gqa_reference(q, k, v, positions, cos, sin, ref_cache, slots, interleaved, qw, kw)
    q_out = nan_like((t, hq, d), device, dtype)
    poison_cuda_allocator()
    rope_cache_gqa(
        q,
        k,
        v,
        positions,
        cos,
        sin,
        cache,
        slots,
        interleaved=interleaved,
        q_norm_weight=qw,
        k_norm_weight=kw,
        q_out=q_out,
        validate=True,
    )
    sync(device)
    exact = not qk_norm and dtype != torch.float32
    _compare(q_out, ref_q, exact, loose)
    assert torch.equal(cache.isnan(), ref_cache.isnan()), "written slots must be written, the rest untouched"
    _compare(torch.nan_to_num(cache), torch.nan_to_num(ref_cache), exact, loose)
    assert torch.equal(cache[:, :, 1], ref_cache[:, :, 1]), "v is copied exactly"


def run_rope_mla_case(device, shape, t, dtype, interleaved, latent_norm, seed, loose=False, absorb_dn=0):
    """rope_cache_mla on latent / k_pe views of one kv_a output, NaN q_pe_out and NaN target cache slots. absorb_dn:
    also q_nope [T, H, DN] (a strided view of the query) times W_UK [H, DN, R] (a strided view of kv_b), checked
    against the float32 einsum; returns (q_latent, (q_nope, w_uk)) for further checks."""
    from specserve.kernels.rope_cache import rope_cache_mla
    from specserve.kernels.rope_cache_reference import rope_cache_mla_reference

    h, r, p = shape
    gen = torch.Generator().manual_seed(seed)
    q_pe = randn((t, h, p), gen, device, dtype, scale=2.0)
    kv_a = randn((t, r + p), gen, device, dtype, scale=2.0)
    latent, k_pe = kv_a[:, :r], kv_a[:, r:]
    cos, sin = rope_tables(4096, p, dtype, device)
    nb, bs = -(-2 * t // 16) + 1, 16
    slots, positions = slots_and_positions(t, nb * bs, 4096, gen, device)
    lw = norm_weight(r, gen, device, dtype) if latent_norm else None
    cache = poison_slots(randn((nb, bs, r + p), gen, device, dtype), slots)
    ref_cache = cache.clone()
    absorb = None
    if absorb_dn:
        q_full = randn((t, h, absorb_dn + p), gen, device, dtype)  # the query: [nope | pe] per head
        kv_b = randn((h, absorb_dn + 32, r), gen, device, dtype, scale=r**-0.5)  # [W_UK; W_UV] per head
        absorb = (q_full[:, :, :absorb_dn], kv_b[:, :absorb_dn])
    ref = rope_cache_mla_reference(
        q_pe, k_pe, latent, positions, cos, sin, ref_cache, slots, interleaved, lw, absorb=absorb
    )
    ref_q, ref_latent = ref if absorb else (ref, None)
    q_out = nan_like((t, h, p), device, dtype)
    poison_cuda_allocator()
    got = rope_cache_mla(
        q_pe,
        k_pe,
        latent,
        positions,
        cos,
        sin,
        cache,
        slots,
        interleaved=interleaved,
        latent_norm_weight=lw,
        q_pe_out=q_out,
        validate=True,
        absorb=absorb,
    )
    sync(device)
    _compare(q_out, ref_q, dtype != torch.float32, loose)  # no norm on q_pe
    assert torch.equal(cache.isnan(), ref_cache.isnan()), "written slots must be written, the rest untouched"
    _compare(torch.nan_to_num(cache), torch.nan_to_num(ref_cache), not latent_norm and dtype != torch.float32, loose)
    if absorb:
        q_latent = got[1]
        assert q_latent.shape == (t, h, r) and not q_latent.isnan().any()
        tol = 2e-2 if loose else 1e-2 if dtype != torch.float32 else 1e-5
        torch.testing.assert_close(q_latent.float(), ref_latent.float(), rtol=tol, atol=tol)
        return q_latent, absorb
    return None


def check_absorb_live_rows(device: str, dtype: torch.dtype, h: int, r: int, p: int, dn: int, t: int) -> None:
    """rope_cache_mla's W_UK product with live_rows: the live rows' q_latent equal the call without it, bit for bit
    (the pad rows after them are skipped: their q_latent rows are not part of the result)."""
    from specserve.kernels.rope_cache import rope_cache_mla

    gen = torch.Generator().manual_seed(t)
    q_nope = randn((t, h, dn), gen, device, dtype)
    w_uk = randn((h, dn, r), gen, device, dtype, scale=dn**-0.5)
    cos, sin = rope_tables(4096, p, dtype, device)

    def call(live: torch.Tensor | None) -> torch.Tensor:
        cache = torch.zeros(4, 16, r + p, device=device, dtype=dtype)
        slots = torch.full((t,), -1, device=device, dtype=torch.int64)
        zeros = [torch.zeros(*shape, device=device, dtype=dtype) for shape in ((t, h, p), (t, p), (t, r))]
        pos = torch.zeros(t, device=device, dtype=torch.int64)
        return rope_cache_mla(*zeros, pos, cos, sin, cache, slots, absorb=(q_nope, w_uk), live_rows=live)[1]

    full = call(None)
    for live in (1, t // 2, t):
        assert torch.equal(call(torch.tensor([live], device=device))[:live], full[:live]), live
