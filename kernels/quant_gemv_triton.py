"""Triton kernels of the W4A16 per-slot GEMV (few tokens: each (token, k) slot against its expert's packed int4 rows,
no tensor cores; wrappers and tiles in quant_gemv.py, format in quant_reference.py).

A program computes BN output rows of a slot, walking the input BKW packed words (8 * BKW columns) a step; nibble j
of word w is input column 8w + j. Per weight three full-rate instructions and no int-to-float conversion: the
nibble at bits b..b+3 (b <= 16), OR-ed under the exponent of 2^(23 - b), is the float 2^(23 - b) + q exactly, so
one subtraction gives q - 8 (the stored offset), exact in fp32, and one FMA adds (q - 8) * x. A word's eight
products are summed, then times the word's group scale (group sizes are multiples of 8).

Choices the tile makes (kernels/quant_gemv.py GemvTile; the sweep, bench/gemv_sweep.py, times them):
- PREFETCH: the next step's words and scales are loaded before this step's arithmetic (registers double-buffered),
  so loads stay in flight while the program computes;
- SPLIT: the input is cut into SPLIT fixed chunks of whole steps, each its own program (grid axis 2), writing fp32
  partial sums that a second pass adds in a fixed order (gate/up: w4a16_gemv_act_kernel; down: the top-k sum), so
  a one-token step has SPLIT times the programs in flight.
Every choice fixes a slot's reduction order over the input (the step, the chunks, the warps' layout), never the slot
count or which program row takes the slot: a slot's bits are the same at any T and LANES (token-count invariant).
"""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.kernels.chain_triton import chain_in

EXP_BITS = 150 << 23  # the kernels' `exp_bits` argument: the fp32 bits of 2^23 (see _q_minus_8)


@triton.jit
def _q_minus_8(words, b: tl.constexpr, exp_bits):
    """fp32 q - 8 of the nibble q at bits b..b+3 of each int32 word (b <= 16): exact, no conversion instruction.
    exp_bits (EXP_BITS) comes in as an argument, not a constant: in a register, the mask and the OR are one LOP3
    (two immediates would take two)."""
    f = ((words & (0xF << b)) | (exp_bits - (b << 23))).to(tl.float32, bitcast=True)  # 2^(23 - b) + q
    return f - ((1 << (23 - b)) + 8)


@triton.jit
def _x(x_row, wcols, j: tl.constexpr, w_hi, EVEN_K: tl.constexpr):
    """[BKW] fp32 inputs 8w + j of the step's words w (x is small and cached: its loads are not prefetched)."""
    if EVEN_K:
        return tl.load(x_row + wcols * 8 + j).to(tl.float32)
    return tl.load(x_row + wcols * 8 + j, mask=wcols < w_hi, other=0.0).to(tl.float32)


@triton.jit
def _x8(x_row, w0, w_hi, BKW: tl.constexpr, EVEN_K: tl.constexpr):
    """The step's inputs: a tuple of 8 [BKW] fp32, j-th the inputs 8w + j of the step's words w."""
    wcols = w0 + tl.arange(0, BKW)
    return (
        _x(x_row, wcols, 0, w_hi, EVEN_K),
        _x(x_row, wcols, 1, w_hi, EVEN_K),
        _x(x_row, wcols, 2, w_hi, EVEN_K),
        _x(x_row, wcols, 3, w_hi, EVEN_K),
        _x(x_row, wcols, 4, w_hi, EVEN_K),
        _x(x_row, wcols, 5, w_hi, EVEN_K),
        _x(x_row, wcols, 6, w_hi, EVEN_K),
        _x(x_row, wcols, 7, w_hi, EVEN_K),
    )


@triton.jit
def _dot_words(words, xs, exp_bits):
    """[BN, BKW] fp32: sum_j (q_j - 8) * xs[j] of each word (xs: _x8's inputs of the step)."""
    hi = words >> 20  # nibbles 5..7 at bits 0..11 (the sign bits it shifts in are masked off)
    p = _q_minus_8(words, 0, exp_bits) * xs[0][None, :]
    p += _q_minus_8(words, 4, exp_bits) * xs[1][None, :]
    p += _q_minus_8(words, 8, exp_bits) * xs[2][None, :]
    p += _q_minus_8(words, 12, exp_bits) * xs[3][None, :]
    p += _q_minus_8(words, 16, exp_bits) * xs[4][None, :]
    p += _q_minus_8(hi, 0, exp_bits) * xs[5][None, :]
    p += _q_minus_8(hi, 4, exp_bits) * xs[6][None, :]
    p += _q_minus_8(hi, 8, exp_bits) * xs[7][None, :]
    return p


@triton.jit
def _load_step(
    wp_e, ws_e, rows, nvalid, w0, w_hi, stride_wn, stride_sn, BKW: tl.constexpr, G: tl.constexpr, EVEN_K: tl.constexpr
):
    """The step at word column w0 of rows (int64 [BN, 1]): packed words [BN, BKW] int32 and their groups' scales
    [BN, BKW * 8 / G] (a group's G / 8 words share one; words from w_hi on, and rows past nvalid, read as 0)."""
    NG: tl.constexpr = BKW * 8 // G
    wcols = w0 + tl.arange(0, BKW)
    gcols = w0 * 8 // G + tl.arange(0, NG)
    if EVEN_K:  # whole steps: one predicate a step (the prefetch past the last step reads nothing)
        mw = tl.broadcast_to(nvalid[:, None] & (w0 < w_hi), [nvalid.shape[0], BKW])
        mg = tl.broadcast_to(nvalid[:, None] & (w0 < w_hi), [nvalid.shape[0], NG])
    else:  # w_hi is a multiple of G / 8 words (H, I and the chunks are whole groups)
        mw = nvalid[:, None] & (wcols < w_hi)[None, :]
        mg = nvalid[:, None] & (gcols * (G // 8) < w_hi)[None, :]
    words = tl.load(wp_e + rows * stride_wn + wcols[None, :], mask=mw, other=0)
    s = tl.load(ws_e + rows * stride_sn + gcols[None, :], mask=mg, other=0.0)
    return words, s


@triton.jit
def _scaled(p, s, G: tl.constexpr):
    """[BN, BKW / GW] fp32: each group's GW = G / 8 word sums p [BN, BKW] added, times the group's scale s."""
    bn: tl.constexpr = p.shape[0]
    bkw: tl.constexpr = p.shape[1]
    return tl.sum(tl.reshape(p, [bn, bkw * 8 // G, G // 8]), axis=2) * s.to(tl.float32)


@triton.jit(do_not_specialize=["N", "LANES"])  # one binary for every slot count: compiles once per tile
def w4a16_gemv_gate_up_kernel(
    x_ptr,  # [T, H]
    wp_ptr,  # [E, 2I, H / 8] int32
    ws_ptr,  # [E, 2I, H / G]
    ids_ptr,  # [N] expert of each flat (token, k) slot
    tw_ptr,  # [N] routing weight of each flat slot (0: the slot is skipped)
    out_ptr,  # SPLIT == 1: [N, I] silu(gate) * up per slot; else [N, SPLIT, 2I] fp32 partial gate and up sums
    N,
    LANES,  # programs along axis 0: program p computes slots p, p + LANES, ... (LANES = N: one slot each)
    TOPK,
    H,
    I,
    chunk,  # words per input chunk (SPLIT chunks; a multiple of BKW)
    exp_bits,  # EXP_BITS
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_on,
    G: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,  # H / 8 is a multiple of BKW: every step is whole
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """A slot of weight 0 (expert parallelism's other ranks' choices, on local expert 0) reads no weights: its act
    row is 0, and the down kernel gives it 0 as the weighted product would. A slot of NO_EXPERT (< 0: the pad rows
    of invariant steps) costs one load: no act row, no per-slot row (the top-k sum skips it unread)."""
    chain_in(PDL)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < I
    rows_g = offs_n.to(tl.int64)[:, None]
    rows_u = rows_g + I
    w_lo = tl.program_id(2) * chunk
    for slot in range(tl.program_id(0), N, LANES):
        e = tl.load(ids_ptr + slot).to(tl.int64)
        if e >= 0:  # (NO_EXPERT: nothing)
            w_hi = tl.where(tl.load(tw_ptr + slot) != 0, tl.minimum(w_lo + chunk, H // 8), w_lo)
            x_row = x_ptr + tl.cast(slot // TOPK, tl.int64) * stride_xt
            wp_e = wp_ptr + e * stride_we
            ws_e = ws_ptr + e * stride_se
            acc_g = tl.zeros([BN, BKW * 8 // G], dtype=tl.float32)
            acc_u = tl.zeros([BN, BKW * 8 // G], dtype=tl.float32)
            if PREFETCH:
                nxt_g, nxt_sg = _load_step(wp_e, ws_e, rows_g, nvalid, w_lo, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K)
                nxt_u, nxt_su = _load_step(wp_e, ws_e, rows_u, nvalid, w_lo, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K)
            for w0 in range(w_lo, w_hi, BKW):
                if PREFETCH:
                    words_g, s_g, words_u, s_u = nxt_g, nxt_sg, nxt_u, nxt_su
                    nxt_g, nxt_sg = _load_step(
                        wp_e, ws_e, rows_g, nvalid, w0 + BKW, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K
                    )
                    nxt_u, nxt_su = _load_step(
                        wp_e, ws_e, rows_u, nvalid, w0 + BKW, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K
                    )
                else:
                    words_g, s_g = _load_step(
                        wp_e, ws_e, rows_g, nvalid, w0, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K
                    )
                    words_u, s_u = _load_step(
                        wp_e, ws_e, rows_u, nvalid, w0, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K
                    )
                xs = _x8(x_row, w0, w_hi, BKW, EVEN_K)  # once a step for gate and up
                acc_g += _scaled(_dot_words(words_g, xs, exp_bits), s_g, G)
                acc_u += _scaled(_dot_words(words_u, xs, exp_bits), s_u, G)
            g = tl.sum(acc_g, axis=1)
            u = tl.sum(acc_u, axis=1)
            if SPLIT == 1:
                act = g * tl.sigmoid(g) * u
                tl.store(
                    out_ptr + tl.cast(slot, tl.int64) * stride_on + offs_n,
                    act.to(out_ptr.dtype.element_ty),
                    mask=nvalid,
                )
            else:
                o_row = out_ptr + (tl.cast(slot, tl.int64) * SPLIT + tl.program_id(2)) * (2 * I)
                tl.store(o_row + offs_n, g, mask=nvalid)
                tl.store(o_row + I + offs_n, u, mask=nvalid)


@triton.jit
def w4a16_gemv_act_kernel(
    part_ptr,  # [N, SPLIT, 2I] fp32 partial gate and up sums
    ids_ptr,  # [N]
    act_ptr,  # [N, I] out: silu(gate) * up per slot (a NO_EXPERT slot's row unwritten)
    I,
    stride_an,
    SPLIT: tl.constexpr,
    BA: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """The split gate/up's second pass: a slot's chunks summed in chunk order (fixed: invariant), then SiLU * up."""
    chain_in(PDL)
    slot = tl.program_id(0).to(tl.int64)
    if tl.load(ids_ptr + slot) >= 0:
        offs = tl.program_id(1) * BA + tl.arange(0, BA)
        m = offs < I
        g = tl.zeros([BA], dtype=tl.float32)
        u = tl.zeros([BA], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            row = part_ptr + (slot * SPLIT + s) * (2 * I)
            g += tl.load(row + offs, mask=m, other=0.0)
            u += tl.load(row + I + offs, mask=m, other=0.0)
        act = g * tl.sigmoid(g) * u
        tl.store(act_ptr + slot * stride_an + offs, act.to(act_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N", "LANES"])
def w4a16_gemv_down_kernel(
    act_ptr,  # [N, I]
    wp_ptr,  # [E, H, I / 8] int32
    ws_ptr,  # [E, H, I / G]
    ids_ptr,  # [N]
    tw_ptr,  # [N] routing weight of each flat slot
    out_ptr,  # [N, SPLIT, H] fp32 out: weighted expert output (SPLIT > 1: of each input chunk) per flat slot
    N,
    LANES,  # as the gate-up kernel's
    H,
    I,
    chunk,  # as the gate-up kernel's
    exp_bits,  # EXP_BITS
    stride_an,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_on,  # a slot's stride in out (SPLIT * H)
    G: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,  # I / 8 is a multiple of BKW
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    """A slot of NO_EXPERT: its per-slot rows stay unwritten (the top-k sum skips them unread); of weight 0: no
    weights read, rows of 0 (see the gate/up kernel)."""
    chain_in(PDL)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nvalid = offs_n < H
    rows = offs_n.to(tl.int64)[:, None]
    w_lo = tl.program_id(2) * chunk
    for slot in range(tl.program_id(0), N, LANES):
        e = tl.load(ids_ptr + slot).to(tl.int64)
        if e >= 0:
            weight = tl.load(tw_ptr + slot).to(tl.float32)
            w_hi = tl.where(weight != 0, tl.minimum(w_lo + chunk, I // 8), w_lo)
            a_row = act_ptr + tl.cast(slot, tl.int64) * stride_an
            wp_e = wp_ptr + e * stride_we
            ws_e = ws_ptr + e * stride_se
            acc = tl.zeros([BN, BKW * 8 // G], dtype=tl.float32)
            if PREFETCH:
                nxt, nxt_s = _load_step(wp_e, ws_e, rows, nvalid, w_lo, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K)
            for w0 in range(w_lo, w_hi, BKW):
                if PREFETCH:
                    words, s = nxt, nxt_s
                    nxt, nxt_s = _load_step(
                        wp_e, ws_e, rows, nvalid, w0 + BKW, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K
                    )
                else:
                    words, s = _load_step(wp_e, ws_e, rows, nvalid, w0, w_hi, stride_wn, stride_sn, BKW, G, EVEN_K)
                acc += _scaled(_dot_words(words, _x8(a_row, w0, w_hi, BKW, EVEN_K), exp_bits), s, G)
            out = tl.sum(acc, axis=1) * weight
            o_row = out_ptr + tl.cast(slot, tl.int64) * stride_on + tl.program_id(2) * H
            tl.store(o_row + offs_n, out, mask=nvalid)
