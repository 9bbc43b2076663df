"""GPU benchmark of the fused MoE against torch._grouped_mm, moe_reference and the bytes floor.

Run on the GPU machine:  specserve bench kernels --suite moe [--out DIR] [--quick]
1. device-to-device copy bandwidth (bytes read + written), the ceiling for the floors below;
2. for each MoE layer shape and token count T: median time per call of fused_moe (Triton), the grouped_mm path
   and moe_reference; the bytes floor = distinct routed experts' weights read once / measured bandwidth.
Timing: CUDA graphs of R calls, each on its own random routing (and, for small layers, its own layer's weights, so
the set of weights touched is far above the 60 MB L2), replayed under triton.testing.do_bench; median / R.
Never zeros: weights, activations and routing are random. The front door prints a short table last and writes
summary.json to --out.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

SHAPES = {  # name: (E, H, I, K, layers)
    "qwen3_30b_a3b": (128, 2048, 768, 8, 8),
    "kimi_k2": (384, 7168, 2048, 8, 1),
}
TOKENS = (1, 2, 4, 8, 16)
LARGE_TOKENS = (64, 256, 1024, 4096)
ROUTINGS = 8


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN never passes a < check)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


@dataclass(frozen=True)
class Row:
    shape: str
    tokens: int
    distinct_experts: float  # mean over the R routings
    floor_ms: float
    fused_ms: float
    grouped_mm_ms: float
    reference_ms: float | None
    fused_rel_err: float
    best_config: str | None = None
    best_config_ms: float | None = None


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def graph_time_ms(fn, calls: int) -> float:
    """Median ms per call of `fn(r)` for r in range(calls), captured in one CUDA graph (NaN if it fails)."""
    try:
        return _graph_time_ms(fn, calls)
    except Exception as exc:  # report and keep benchmarking the other variants
        print(f"  timing failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def _graph_time_ms(fn, calls: int) -> float:
    import triton.testing

    for r in range(calls):  # compile / warm up outside capture
        fn(r)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(calls):
            fn(r)
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
    return ms / calls


def bench_shape(name: str, tokens: tuple[int, ...], bw: float, sweep: bool, with_ref: bool) -> list[Row]:
    import triton.testing

    from specserve.kernels.fused_moe import MoETileConfig, fused_moe, moe_grouped_mm
    from specserve.kernels.moe_reference import moe_reference

    e, h, i, k, layers = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = [
        torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(h**-0.5)
        for _ in range(layers)
    ]
    w2 = [torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(i**-0.5) for _ in range(layers)]
    bytes_per_expert = 3 * h * i * w13[0].element_size()
    rows = []
    for t in tokens:
        xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(ROUTINGS)]
        routing = []
        for _ in range(ROUTINGS):
            probs = torch.softmax(torch.randn(t, e, device="cuda", generator=gen), -1)
            w, ids = torch.topk(probs, k, dim=-1)
            routing.append((ids.contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()))
        distinct = sum(int(torch.unique(ids).numel()) for ids, _ in routing) / ROUTINGS
        floor_ms = distinct * bytes_per_expert / bw * 1e3

        def call(r, fn=fused_moe, **kw):
            return fn(xs[r], w13[r % layers], w2[r % layers], routing[r][0], routing[r][1], **kw)

        fused_ms = graph_time_ms(lambda r: call(r, backend="triton"), ROUTINGS)
        gmm_ms = graph_time_ms(lambda r: call(r, moe_grouped_mm), ROUTINGS)
        ref_out = call(0, moe_reference)
        out = call(0, backend="triton")
        err = rel_err(out, ref_out)
        ref_ms = None
        if with_ref:
            ref_ms = triton.testing.do_bench(lambda: call(0, moe_reference), warmup=5, rep=50, return_mode="median")
        best = best_ms = None
        if sweep:
            for cfg in sweep_configs(t, MoETileConfig):
                ms = graph_time_ms(lambda r, c=cfg: call(r, backend="triton", config=c), ROUTINGS)
                if ms == ms and (best_ms is None or ms < best_ms):
                    best, best_ms = cfg, ms
        rows.append(
            Row(
                name, t, distinct, floor_ms, fused_ms, gmm_ms, ref_ms, err, str(asdict(best)) if best else None, best_ms
            )
        )
        print(
            f"  {name} T={t}: fused {fused_ms:.4f} ms, grouped_mm {gmm_ms:.4f}, floor {floor_ms:.4f}, "
            f"err {err:.2e}" + (f", best sweep {best_ms:.4f} {best}" if best else ""),
            flush=True,
        )
    w13.clear()  # free this shape's weights before the next one
    w2.clear()
    torch.cuda.empty_cache()
    return rows


ATTN_CASES = (  # name, kind, requests, new tokens each, context, tree
    ("gqa_decode", "gqa", 1, 1, 4096, False),
    ("gqa_decode", "gqa", 8, 1, 4096, False),
    ("gqa_verify_tree", "gqa", 1, 16, 4096, True),
    ("gqa_verify_tree", "gqa", 8, 8, 4096, True),
    ("mla_decode", "mla", 1, 1, 4096, False),
    ("mla_decode", "mla", 8, 1, 4096, False),
    ("mla_verify_chain", "mla", 1, 8, 4096, False),
    ("mla_verify_tree", "mla", 1, 16, 4096, True),
)
GQA_DIMS = (32, 4, 128)  # Qwen3-30B-A3B: q heads, kv heads, head dim
MLA_DIMS = (64, 512, 64)  # Kimi-K2: heads, kv_lora_rank, rope dim


def bench_attention(bw: float) -> list[dict]:
    """FlashInfer wrappers vs the torch references: median ms, KV-bytes floor, relative error."""
    import triton.testing

    from specserve.kernels import attention as fa
    from specserve.kernels.attention_reference import (
        mla_attention_reference,
        paged_attention_reference,
    )
    from specserve.kernels.paged_batch import PagedBatch

    if not fa.HAS_FLASHINFER:
        print(f"  attention skipped: {fa.FLASHINFER_IMPORT_ERROR}")
        return []
    gen = torch.Generator(device="cuda").manual_seed(1)
    block, rows = 16, []
    for name, kind, b, q, ctx, tree in ATTN_CASES:
        per_req = -(-(ctx + q) // block)
        perm = torch.randperm(b * per_req, device="cpu").tolist()
        tables = [perm[i * per_req : (i + 1) * per_req] for i in range(b)]
        masks = None
        if tree:
            masks = []
            for _ in range(b):
                m = torch.eye(q, dtype=torch.bool)
                for j in range(1, q):
                    m[j] |= m[(j - 1) // 2]  # binary tree in topological order
                masks.append(m)
        batch = PagedBatch.build([q] * b, [ctx] * b, tables, block, masks)
        if kind == "gqa":
            hq, hkv, d = GQA_DIMS
            cache = torch.randn(b * per_req, block, 2, hkv, d, device="cuda", generator=gen).bfloat16()
            qt = torch.randn(b * q, hq, d, device="cuda", generator=gen).bfloat16()
            att = fa.StepAttention(fa.AttnDims(False, hq, hkv, d, 0, d**-0.5, torch.bfloat16), block, "cuda")
            att.plan(batch)
            fast, ref = (lambda: att.run_gqa(qt, cache)), (lambda: paged_attention_reference(qt, cache, batch))
            kv_bytes = b * (ctx + q) * 2 * hkv * d * 2
        else:
            h, r, p = MLA_DIMS
            cache = torch.randn(b * per_req, block, r + p, device="cuda", generator=gen).bfloat16()
            qn = torch.randn(b * q, h, r, device="cuda", generator=gen).bfloat16()
            qp = torch.randn(b * q, h, p, device="cuda", generator=gen).bfloat16()
            att = fa.StepAttention(fa.AttnDims(True, h, 1, r, p, 192**-0.5, torch.bfloat16), block, "cuda")
            att.plan(batch)
            fast = lambda: att.run_mla(qn, qp, cache)  # noqa: E731
            ref = lambda: mla_attention_reference(qn, qp, cache, batch, 192**-0.5)  # noqa: E731
            kv_bytes = b * (ctx + q) * (r + p) * 2
        out, expect = fast(), ref()
        err = rel_err(out, expect)
        eager_ms = triton.testing.do_bench(fast, warmup=10, rep=60, return_mode="median")
        graph_ms = graph_time_ms(lambda r_, f=fast: f(), 1)
        ref_ms = triton.testing.do_bench(ref, warmup=3, rep=30, return_mode="median")
        row = {
            "case": f"{name} B={b} q={q} ctx={ctx}",
            "floor_ms": kv_bytes / bw * 1e3,
            "graph_ms": graph_ms,
            "eager_ms": eager_ms,
            "reference_ms": ref_ms,
            "rel_err": err,
        }
        rows.append(row)
        print(
            f"  {row['case']}: graph {graph_ms:.4f} ms eager {eager_ms:.4f} ref {ref_ms:.3f} "
            f"floor {row['floor_ms']:.4f} err {err:.1e}",
            flush=True,
        )
    return rows


def sweep_configs(t: int, cfg_cls) -> list:
    """A few tile shapes around the default, for one-shot tuning of the decode path."""
    bm = 16 if t <= 16 else (32 if t <= 32 else 64)
    return [
        cfg_cls(bm, 32, 128, 4, 4, 64, 128, 4, 4),
        cfg_cls(bm, 64, 64, 4, 4, 64, 64, 4, 4),
        cfg_cls(bm, 16, 256, 4, 4, 32, 256, 4, 4),
        cfg_cls(bm, 32, 256, 4, 3, 32, 128, 4, 4),
        cfg_cls(bm, 64, 128, 8, 3, 128, 128, 8, 3),
        cfg_cls(bm, 32, 64, 2, 6, 32, 64, 2, 6),
    ]


def format_table(bw: float, rows: list[Row]) -> str:
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)",
        f"{'shape':14} {'T':>5} {'experts':>7} {'floor ms':>9} {'fused ms':>9} {'x floor':>7} "
        f"{'gmm ms':>8} {'x floor':>7} {'ref ms':>8} {'best ms':>8} {'err':>8}",
    ]
    for r in rows:
        ref = f"{r.reference_ms:8.3f}" if r.reference_ms is not None else f"{'-':>8}"
        best = f"{r.best_config_ms:8.4f}" if r.best_config_ms is not None else f"{'-':>8}"
        lines.append(
            f"{r.shape:14} {r.tokens:5d} {r.distinct_experts:7.1f} {r.floor_ms:9.4f} {r.fused_ms:9.4f} "
            f"{r.fused_ms / r.floor_ms:7.2f} {r.grouped_mm_ms:8.4f} {r.grouped_mm_ms / r.floor_ms:7.2f} {ref} {best} "
            f"{r.fused_rel_err:8.1e}"
        )
    return "\n".join(lines)


def run(quick: bool = False, log=print) -> dict:
    """The fused MoE against grouped_mm and the reference at every shape and T, and the attention kernels (CUDA only:
    the front door refuses a CPU before this)."""
    start = time.time()
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    rows: list[Row] = []
    for name in SHAPES:
        rows += bench_shape(name, TOKENS, bw, sweep=not quick, with_ref=True)
        if not quick:
            rows += bench_shape(
                name, LARGE_TOKENS if name != "kimi_k2" else LARGE_TOKENS[:2], bw, sweep=False, with_ref=False
            )
    attn = bench_attention(bw)
    return {
        "copy_bandwidth_Bps": bw,
        "rows": [asdict(r) for r in rows],
        "attention": attn,
        "seconds": time.time() - start,
    }


def format_result(result: dict) -> str:
    lines = [
        f"{a['case']:38} graph {a['graph_ms']:.4f} ms  eager {a['eager_ms']:.4f}  ref {a['reference_ms']:.3f}  "
        f"floor {a['floor_ms']:.4f}  err {a['rel_err']:.1e}"
        for a in result["attention"]
    ]
    lines.append(format_table(result["copy_bandwidth_Bps"], [Row(**r) for r in result["rows"]]))
    return "\n".join(lines)
