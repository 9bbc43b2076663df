"""GPU benchmark of the quantized kernels (W4A16 and FP8 fused MoE, FP8 dense GEMV) against their bytes floors.

Run on the GPU machine:  specserve bench kernels --suite quant [--out DIR] [--quick]
(`--gemv-sweep` runs bench/gemv_sweep.py in its place: the W4A16 GEMV's tiles, checked, then timed.)
Rows: a Kimi-K2 layer in INT4 (384 experts, H 7168, I 2048, top-8, group 32); Qwen3-30B-A3B (8 layers, so the
weights touched exceed L2) and a DeepSeek-V3 layer in FP8 blocks of 128; DeepSeek-V3's dense attention and
shared-expert weights in FP8; T = 1..16 tokens (decode and verify). Synthetic weights: random packed words /
e4m3 bytes and scales, never zeros. The floor counts the bytes each format stores: packed int32 words plus
bf16 group scales, or e4m3 bytes plus float32 block scales (floors.int4_linear_bytes / fp8_linear_bytes), of
the distinct experts the routing touches, over the measured copy bandwidth. Target (reported, not
asserted): within 1.3x of the floor. Timing as kernel_bench: CUDA graphs of R calls on R routings.
"""

from __future__ import annotations

import time

import torch

from specserve.bench.floors import fp8_linear_bytes, int4_linear_bytes
from specserve.bench.kernel_bench import ROUTINGS, copy_bandwidth, graph_time_ms, rel_err

MOE_SHAPES = {  # name: (format, E, H, I, K, layers)
    "kimi_k2_int4": ("int4", 384, 7168, 2048, 8, 1),
    "qwen3_30b_a3b_fp8": ("fp8", 128, 2048, 768, 8, 8),
    "deepseek_v3_fp8": ("fp8", 256, 7168, 2048, 8, 1),
}
DENSE_SHAPES = {  # DeepSeek-V3 / Kimi-K2 per layer (out, in)
    "q_a": (1536, 7168),
    "q_b": (24576, 1536),
    "kv_a": (576, 7168),
    "kv_b": (32768, 512),
    "o_proj": (7168, 16384),
    "shared_gate_up": (4096, 7168),
    "shared_down": (7168, 2048),
}
TOKENS = (1, 2, 4, 8, 16)
GROUP, BLOCK = 32, (128, 128)


def expert_bytes(fmt: str, h: int, i: int) -> int:
    """Stored bytes of one expert (gate [I, H] + up [I, H] + down [H, I])."""
    if fmt == "int4":
        return 2 * int4_linear_bytes(i, h, GROUP) + int4_linear_bytes(h, i, GROUP)
    return 2 * fp8_linear_bytes(i, h, BLOCK) + fp8_linear_bytes(h, i, BLOCK)


def _random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 values up to ~30 in magnitude, made from random bytes (no fp32 copy of the tensor)."""
    b = torch.randint(0, 0x58, shape, dtype=torch.uint8, device="cuda", generator=gen)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device="cuda", generator=gen) << 7
    return (b | sign).view(torch.float8_e4m3fn)


def _weights(fmt: str, e: int, h: int, i: int, gen: torch.Generator):
    if fmt == "int4":
        words = lambda *s: torch.randint(-(2**31), 2**31 - 1, s, dtype=torch.int32, device="cuda", generator=gen)  # noqa: E731
        scale = lambda *s: (torch.rand(*s, device="cuda", generator=gen) * 0.02).bfloat16()  # noqa: E731
        return words(e, 2 * i, h // 8), scale(e, 2 * i, h // GROUP), words(e, h, i // 8), scale(e, h, i // GROUP)
    bo, bi = BLOCK
    scale = lambda *s: torch.rand(*s, device="cuda", generator=gen) * 2e-3  # noqa: E731
    return (
        _random_fp8((e, 2 * i, h), gen),
        scale(e, -(-2 * i // bo), -(-h // bi)),
        _random_fp8((e, h, i), gen),
        scale(e, -(-h // bo), -(-i // bi)),
    )


def bench_moe(name: str, tokens: tuple[int, ...], bw: float) -> list[dict]:
    from specserve.kernels import quant_moe
    from specserve.kernels import quant_reference as ref

    fmt, e, h, i, k, layers = MOE_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [_weights(fmt, e, h, i, gen) for _ in range(layers)]
    kernel = quant_moe.w4a16_moe if fmt == "int4" else quant_moe.fp8_moe
    reference = ref.w4a16_moe_reference if fmt == "int4" else ref.fp8_moe_reference
    extra = {"group_size": GROUP} if fmt == "int4" else {"block": BLOCK}
    rows = []
    for t in tokens:
        xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(ROUTINGS)]
        routing = []
        for _ in range(ROUTINGS):
            w, ids = torch.topk(torch.softmax(torch.randn(t, e, device="cuda", generator=gen), -1), k, dim=-1)
            routing.append((ids.contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()))
        distinct = sum(int(torch.unique(ids).numel()) for ids, _ in routing) / ROUTINGS
        floor_ms = distinct * expert_bytes(fmt, h, i) / bw * 1e3

        def call(r, fn=kernel):
            return fn(xs[r], *weights[r % layers], routing[r][0], routing[r][1], **extra)

        ms = graph_time_ms(call, ROUTINGS)
        out, want = call(0), call(0, reference)
        err = rel_err(out, want)
        rows.append(
            {
                "shape": name,
                "format": fmt,
                "tokens": t,
                "distinct_experts": distinct,
                "floor_ms": floor_ms,
                "kernel_ms": ms,
                "x_floor": ms / floor_ms,
                "rel_err": err,
            }
        )
        print(f"  {name} T={t}: {ms:.4f} ms, floor {floor_ms:.4f} ({ms / floor_ms:.2f}x), err {err:.1e}", flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return rows


def bench_dense(tokens: tuple[int, ...], bw: float) -> list[dict]:
    from specserve.kernels.quant_moe import fp8_linear
    from specserve.kernels.quant_reference import fp8_linear_reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    bo, bi = BLOCK
    rows = []
    for name, (n, kdim) in DENSE_SHAPES.items():
        copies = ROUTINGS  # distinct weights per graph replay, so L2 holds none of them
        ws = [
            (_random_fp8((n, kdim), gen), torch.rand(-(-n // bo), -(-kdim // bi), device="cuda", generator=gen) * 2e-3)
            for _ in range(copies)
        ]
        floor_ms = fp8_linear_bytes(n, kdim, BLOCK) / bw * 1e3
        for t in tokens:
            x = torch.randn(t, kdim, device="cuda", dtype=torch.bfloat16, generator=gen)
            ms = graph_time_ms(lambda r, x=x: fp8_linear(x, *ws[r], BLOCK), copies)
            out, want = fp8_linear(x, *ws[0], BLOCK), fp8_linear_reference(x, *ws[0], BLOCK)
            err = rel_err(out, want)
            rows.append(
                {
                    "shape": f"fp8_dense_{name}",
                    "format": "fp8",
                    "tokens": t,
                    "floor_ms": floor_ms,
                    "kernel_ms": ms,
                    "x_floor": ms / floor_ms,
                    "rel_err": err,
                }
            )
            print(
                f"  dense {name} [{n}, {kdim}] T={t}: {ms:.4f} ms, floor {floor_ms:.4f} ({ms / floor_ms:.2f}x), "
                f"err {err:.1e}",
                flush=True,
            )
    return rows


def run(quick: bool = False, log=print) -> dict:
    """The quantized MoE and dense kernels at every shape and T (CUDA only: the front door refuses a CPU first)."""
    start = time.time()
    tokens = (1, 16) if quick else TOKENS
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = [row for name in MOE_SHAPES for row in bench_moe(name, tokens, bw)] + bench_dense(tokens, bw)
    return {"copy_bandwidth_Bps": bw, "rows": rows, "seconds": time.time() - start}


def format_result(result: dict) -> str:
    lines = [f"{'shape':26} {'T':>3} {'floor ms':>9} {'kernel ms':>9} {'x floor':>7} {'err':>8}"]
    for r in result["rows"]:
        lines.append(
            f"{r['shape']:26} {r['tokens']:3d} {r['floor_ms']:9.4f} {r['kernel_ms']:9.4f} "
            f"{r['x_floor']:7.2f} {r['rel_err']:8.1e}"
        )
    return "\n".join(lines)
