"""Triton kernels of the row-metadata paged attention (imported only where triton is installed; see
paged_attention.py for the checked wrappers and paged_rows.py for the metadata).

One program per (row, head group, kv split): one online-softmax pass (base 2) over its share of the request's
kv indices, BLOCK_N at a time, each index read through the block table (so any block size works). With
SPLITS == 1 the program normalises and writes the output; otherwise it writes its unnormalised partial
(acc, running max m, sum l) and combine_splits_kernel merges the splits. A row that sees nothing ends with
l = 0 and acc = 0 and writes zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in

M_INIT = tl.constexpr(-1.0e30)  # finite start for the running max: an all-masked tile then gives p = 0, never NaN


@triton.jit
def _row_span(row, req_s, valid, row_idx_ptr, kv_lens_ptr, new_starts_ptr, kv_cap, HAS_TREE: tl.constexpr):
    """(kv length of the row's request, kv indices the row itself can see: [0, seen)). A chain or path row j sees
    its request's cached keys and new tokens 0..j, so seen = new_start + j + 1 (the length a one-token decode of that
    token attends over); a row read through a tree mask may see any new token, so seen = the request's kv length."""
    kv_len = tl.where(valid, tl.load(kv_lens_ptr + req_s), 0)
    kv_len = tl.maximum(tl.minimum(kv_len, kv_cap), 0)
    new_start = tl.where(valid, tl.load(new_starts_ptr + req_s), 0)  # (where: a 0-d value under the interpreter)
    j = tl.where(valid, tl.load(row_idx_ptr + row), 0)
    seen = kv_len if HAS_TREE else tl.minimum(new_start + j + 1, kv_len)
    return kv_len, tl.maximum(seen, 0), new_start, j


@triton.jit
def _row_chunk(seen, split_chunk, SPLITS: tl.constexpr):
    """Kv indices per split of a row with per-row ranges: the fewest multiples of split_chunk that cover `seen` in
    SPLITS splits. A function of the row's own visible length alone, so a token's tiles are the same in a decode and
    in any verify step that holds it (token-count invariant steps)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seen, SPLITS), split_chunk), 1) * split_chunk


@triton.jit
def _row_setup(
    row,
    row_req_ptr,
    row_idx_ptr,
    kv_lens_ptr,
    new_starts_ptr,
    num_requests,
    kv_cap,
    split,
    split_chunk,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    ROW_RANGES: tl.constexpr,
):
    """(request (clamped to a valid one), new token index, new_start, this split's kv range [lo, hi)). ROW_RANGES
    (split_chunk > 0, a multiple of BLOCK_N): per-row ranges over what the row itself sees (_row_chunk), so a row's tiles and their
    merge order depend on neither the step's rows nor how many keys its request holds (invariant steps); 0: the
    request's kv length split evenly."""
    req = tl.load(row_req_ptr + row)
    valid = (req >= 0) & (req < num_requests)
    req_s = tl.where(valid, req, 0)
    kv_len, seen, new_start, j = _row_span(
        row, req_s, valid, row_idx_ptr, kv_lens_ptr, new_starts_ptr, kv_cap, HAS_TREE
    )
    if ROW_RANGES:
        chunk = _row_chunk(seen, split_chunk, SPLITS)
        end = seen
    else:
        chunk = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
        end = kv_len
    lo = tl.minimum(split * chunk, end)
    hi = tl.minimum(lo + chunk, end)
    return req_s, j, new_start, lo, hi


@triton.jit
def _visible(row, s, hi, new_start, j, tree_ptr, stride_tree, max_new, HAS_TREE: tl.constexpr):
    """[BLOCK_N] bool: which kv indices s (< hi) the row sees."""
    in_range = s < hi
    t = s - new_start
    if HAS_TREE:
        ok = (t >= 0) & (t < max_new) & in_range
        see_new = tl.load(tree_ptr + row * stride_tree + t, mask=ok, other=0) != 0
    else:
        see_new = t <= j
    return in_range & ((t < 0) | see_new)


@triton.jit
def _source(row, s, in_range, new_start, j, path_ptr, stride_path, PATHS: tl.constexpr):
    """[BLOCK_N] kv indices to read for positions s. PATHS: a row reads its new tokens in path order (position
    new_start + t holds node path[row, t], its depth-t ancestor, for t <= j = its depth), so every row sees its keys
    at the positions a one-token decode of its path would (token-count invariant tree steps)."""
    src = s
    if PATHS:
        t = s - new_start
        on_path = (t >= 0) & (t <= j) & in_range
        node = tl.load(path_ptr + row * stride_path + t, mask=on_path, other=0)
        src = tl.where(t >= 0, new_start + node, s)
    return src


@triton.jit
def _finish(
    acc,
    m_i,
    l_i,
    out_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    row,
    head,
    head_ok,
    offs_d,
    d_ok,
    split,
    keep,
    stride_on,
    stride_oh,
    SPLITS: tl.constexpr,
    H_TOTAL: tl.constexpr,
    DV: tl.constexpr,
):
    """Normalise and store (one split), or store the partial into the split workspace (only where `keep`: a per-row
    range past its request's keys stores nothing, combine_fixed_splits_kernel never reads it)."""
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        ptrs = out_ptr + row * stride_on + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        base = (row * H_TOTAL + head) * SPLITS + split  # [G] partial index of (row, head, split)
        ok = head_ok & ((head * 0 + keep) > 0)  # keep: int32 0 / 1 (a vector compare keeps the mask boolean)
        tl.store(ws_acc_ptr + base[:, None].to(tl.int64) * DV + offs_d[None, :], acc, mask=ok[:, None] & d_ok[None, :])
        tl.store(ws_ml_ptr + base.to(tl.int64) * 2, m_i, mask=ok)
        tl.store(ws_ml_ptr + base.to(tl.int64) * 2 + 1, l_i, mask=ok)


@triton.jit
def gqa_rows_kernel(
    q_ptr,  # [N, Hq, D]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, 2, HKV, D] contiguous
    out_ptr,  # [N, Hq, D] (SPLITS == 1)
    ws_acc_ptr,  # [N, Hq, SPLITS, D] fp32 (SPLITS > 1)
    ws_ml_ptr,  # [N, Hq, SPLITS, 2] fp32 (SPLITS > 1)
    block_tables_ptr,  # [B, max_blocks] int32
    kv_lens_ptr,  # [B] int32
    new_starts_ptr,  # [B] int32
    row_req_ptr,  # [N] int32
    row_idx_ptr,  # [N] int32
    tree_ptr,  # [N, max_new] uint8 (HAS_TREE)
    path_ptr,  # [N, max_new] int32 (PATHS)
    num_requests,
    max_blocks,
    max_new,
    qk_scale,  # sm_scale * log2(e)
    split_chunk,  # > 0: kv indices per split, fixed (_row_setup)
    stride_qn,
    stride_qh,
    stride_bt,
    stride_tree,
    stride_path,
    stride_on,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,  # query heads per kv head
    G_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    PATHS: tl.constexpr,  # new tokens read in path order (_source); row_idx = the row's depth; not with HAS_TREE
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_RANGES: tl.constexpr,  # split_chunk > 0: per-row split ranges (_row_setup)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req, j, new_start, lo, hi = _row_setup(
        row,
        row_req_ptr,
        row_idx_ptr,
        kv_lens_ptr,
        new_starts_ptr,
        num_requests,
        max_blocks * BLOCK_SIZE,
        split,
        split_chunk,
        SPLITS,
        BLOCK_N,
        HAS_TREE,
        ROW_RANGES,
    )
    if ROW_RANGES and SPLITS > 1:
        if lo >= hi:  # a split past what the row sees (a pad row sees nothing): no partial, the merge skips it
            return
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    head = kvh * G + offs_g
    head_ok = offs_g < G
    d_ok = offs_d < D
    q = tl.load(
        q_ptr + row * stride_qn + head[:, None] * stride_qh + offs_d[None, :],
        mask=head_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([G_PAD], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    entry = 2 * HKV * D
    for start in range(lo, hi, BLOCK_N):
        s = start + offs_n
        in_range = s < hi
        src = _source(row, s, in_range, new_start, j, path_ptr, stride_path, PATHS)
        page = tl.load(block_tables_ptr + req * stride_bt + src // BLOCK_SIZE, mask=in_range, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + src % BLOCK_SIZE
        kv_ptrs = cache_ptr + slot[:, None] * entry + kvh * D + offs_d[None, :]
        kv_mask = in_range[:, None] & d_ok[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v = tl.load(kv_ptrs + HKV * D, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G_PAD, BLOCK_N]
        vis = _visible(row, s, hi, new_start, j, tree_ptr, stride_tree, max_new, HAS_TREE)
        scores = tl.where(vis[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    _finish(
        acc,
        m_i,
        l_i,
        out_ptr,
        ws_acc_ptr,
        ws_ml_ptr,
        row,
        head,
        head_ok,
        offs_d,
        d_ok,
        split,
        tl.where(lo < tl.where(ROW_RANGES, hi, lo + 1), 1, 0),
        stride_on,
        stride_oh,
        SPLITS,
        HKV * G,
        D,
    )


@triton.jit
def mla_rows_kernel(
    qn_ptr,  # [N, H, R]
    qp_ptr,  # [N, H, P]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, R + P] contiguous
    out_ptr,  # [N, H, R] (SPLITS == 1)
    ws_acc_ptr,  # [N, H, SPLITS, R] fp32 (SPLITS > 1)
    ws_ml_ptr,  # [N, H, SPLITS, 2] fp32 (SPLITS > 1)
    block_tables_ptr,
    kv_lens_ptr,
    new_starts_ptr,
    row_req_ptr,
    row_idx_ptr,
    tree_ptr,
    path_ptr,
    num_requests,
    max_blocks,
    max_new,
    qk_scale,
    split_chunk,
    stride_qnn,
    stride_qnh,
    stride_qpn,
    stride_qph,
    stride_bt,
    stride_tree,
    stride_path,
    stride_on,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    H: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    HB: tl.constexpr,  # heads per program (padded block)
    R_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    PATHS: tl.constexpr,  # new tokens read in path order (_source); row_idx = the row's depth; not with HAS_TREE
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_RANGES: tl.constexpr,  # split_chunk > 0: per-row split ranges (_row_setup)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    chain_in(PDL)
    row = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    req, j, new_start, lo, hi = _row_setup(
        row,
        row_req_ptr,
        row_idx_ptr,
        kv_lens_ptr,
        new_starts_ptr,
        num_requests,
        max_blocks * BLOCK_SIZE,
        split,
        split_chunk,
        SPLITS,
        BLOCK_N,
        HAS_TREE,
        ROW_RANGES,
    )
    if ROW_RANGES and SPLITS > 1:
        if lo >= hi:  # a split past what the row sees (a pad row sees nothing): no partial, the merge skips it
            return
    offs_h = tl.arange(0, HB)
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    head = hblk * HB + offs_h
    head_ok = head < H
    r_ok = offs_r < R
    p_ok = offs_p < P
    qn = tl.load(
        qn_ptr + row * stride_qnn + head[:, None] * stride_qnh + offs_r[None, :],
        mask=head_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    qp = tl.load(
        qp_ptr + row * stride_qpn + head[:, None] * stride_qph + offs_p[None, :],
        mask=head_ok[:, None] & p_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([HB], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([HB], dtype=tl.float32)
    acc = tl.zeros([HB, R_PAD], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        s = start + offs_n
        in_range = s < hi
        src = _source(row, s, in_range, new_start, j, path_ptr, stride_path, PATHS)
        page = tl.load(block_tables_ptr + req * stride_bt + src // BLOCK_SIZE, mask=in_range, other=0)
        base = cache_ptr + (page.to(tl.int64) * BLOCK_SIZE + src % BLOCK_SIZE) * (R + P)
        lat = tl.load(base[:, None] + offs_r[None, :], mask=in_range[:, None] & r_ok[None, :], other=0.0)
        kpe = tl.load(base[:, None] + R + offs_p[None, :], mask=in_range[:, None] & p_ok[None, :], other=0.0)
        scores = tl.dot(qn, tl.trans(lat), input_precision=PRECISION)
        scores = (scores + tl.dot(qp, tl.trans(kpe), input_precision=PRECISION)) * qk_scale  # [HB, BLOCK_N]
        vis = _visible(row, s, hi, new_start, j, tree_ptr, stride_tree, max_new, HAS_TREE)
        scores = tl.where(vis[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
        m_i = m_new
    _finish(
        acc,
        m_i,
        l_i,
        out_ptr,
        ws_acc_ptr,
        ws_ml_ptr,
        row,
        head,
        head_ok,
        offs_r,
        r_ok,
        split,
        tl.where(lo < tl.where(ROW_RANGES, hi, lo + 1), 1, 0),
        stride_on,
        stride_oh,
        SPLITS,
        H,
        R,
    )


@triton.jit
def combine_splits_kernel(
    ws_acc_ptr,  # [N, H, SPLITS, DV] fp32
    ws_ml_ptr,  # [N, H, SPLITS, 2] fp32
    out_ptr,  # [N, H, DV]
    stride_on,
    stride_oh,
    H: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s per (row, head); zeros where every l_s is 0."""
    chain_in(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, DV_PAD)
    s_ok = offs_s < SPLITS
    base = (row * H + head) * SPLITS + offs_s  # [S_PAD]
    m = tl.load(ws_ml_ptr + base.to(tl.int64) * 2, mask=s_ok, other=M_INIT)
    l_s = tl.load(ws_ml_ptr + base.to(tl.int64) * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(
        ws_acc_ptr + base[:, None].to(tl.int64) * DV + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < DV)[None, :],
        other=0.0,
    )
    w = tl.exp2(m - tl.max(m, 0))  # [S_PAD]
    total = tl.sum(w * l_s, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < DV)


@triton.jit
def combine_fixed_splits_kernel(
    ws_acc_ptr,  # [N, H, SPLITS, DV] fp32
    ws_ml_ptr,  # [N, H, SPLITS, 2] fp32
    out_ptr,  # [N, H, DV]
    row_req_ptr,  # [N] int32
    row_idx_ptr,  # [N] int32
    kv_lens_ptr,  # [B] int32
    new_starts_ptr,  # [B] int32
    num_requests,
    kv_cap,
    split_chunk,  # the per-row ranges' granule (> 0, _row_chunk)
    stride_on,
    stride_oh,
    H: tl.constexpr,
    DV: tl.constexpr,
    DV_BLOCK: tl.constexpr,  # output columns per program (grid axis 2)
    SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_TREE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """The per-row splits of a row merged at once: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the
    splits that hold keys the row sees (the others masked to exact zeros). Which splits those are, and the order of
    every sum, are functions of the row's own visible length (_row_span, _row_chunk), so a row's result depends on
    neither the step's rows nor its request's kv length (token-count invariant steps)."""
    chain_in(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * DV_BLOCK + tl.arange(0, DV_BLOCK)
    req = tl.load(row_req_ptr + row)
    valid = (req >= 0) & (req < num_requests)
    kv_len, seen, new_start, j = _row_span(
        row, tl.where(valid, req, 0), valid, row_idx_ptr, kv_lens_ptr, new_starts_ptr, kv_cap, HAS_TREE
    )
    used = tl.minimum(tl.cdiv(seen, _row_chunk(seen, split_chunk, SPLITS)), SPLITS)
    offs_s = tl.arange(0, S_PAD)
    s_ok = offs_s < used
    base = ((row * H + head) * SPLITS + offs_s).to(tl.int64)  # [S_PAD]
    m = tl.load(ws_ml_ptr + base * 2, mask=s_ok, other=M_INIT)
    l_s = tl.load(ws_ml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    d_ok = offs_d < DV
    acc = tl.load(ws_acc_ptr + base[:, None] * DV + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.where(s_ok, tl.exp2(m - tl.max(m, 0)), 0.0)  # [S_PAD]
    total = tl.sum(w * l_s, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
