"""The MoE router after the gate GEMM in one kernel: scores, correction bias, grouped top-k, top-k,
renormalisation and scaling.

  route(logits [T, E], cfg: RouterConfig, correction_bias [E] | None) -> (topk_ids [T, K] int32,
                                                                          topk_weights [T, K] fp32)
Same rule as router_reference.py (the model's TopKRouter): on inputs without ties the ids are equal and in the
same order (descending choice score); ties go to the lowest expert id. One program per token, no host syncs
(CUDA-graph capturable); `topk_ids=` / `topk_weights=` take caller buffers. `live_rows=` ([1] int64, device data:
the target's invariant steps) routes the rows from it on to NO_EXPERT (-1) at weight 0 without scoring them.
"""

from __future__ import annotations

import torch

from specserve.kernels.checks import check_dim, check_same_device, check_tensor, require, triton_interpreting
from specserve.kernels.router_reference import RouterConfig

try:
    import triton

    from specserve.kernels import router_triton as _k

    HAS_TRITON = True
except ImportError:  # CPU-only installs (CI) have no triton; router_reference.py still works.
    HAS_TRITON = False

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 4096
MAX_TOP_K = 64


def _out(
    name: str, buf: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, like: torch.Tensor
) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    check_tensor(name, buf, 2, (dtype,))
    require(tuple(buf.shape) == shape, f"{name} has shape {tuple(buf.shape)}, expected {shape}")
    check_same_device([("logits", like), (name, buf)])
    return buf


def route(
    logits: torch.Tensor,  # [T, E] gate GEMM output (rows may be strided; last dim contiguous)
    cfg: RouterConfig,
    correction_bias: torch.Tensor | None = None,  # [E] fp32/bf16/fp16, for the choice only
    *,
    topk_ids: torch.Tensor | None = None,  # [T, K] int32 out
    topk_weights: torch.Tensor | None = None,  # [T, K] fp32 out
    live_rows: torch.Tensor | None = None,  # [1] int64 on the logits' device: rows from it on route to NO_EXPERT
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_ids [T, K] int32, topk_weights [T, K] fp32)
    require(isinstance(cfg, RouterConfig), f"cfg must be a RouterConfig, got {type(cfg).__name__}")
    check_tensor("logits", logits, 2, _LOGIT_DTYPES, contiguous=False)
    require(logits.stride(1) == 1, f"logits must be contiguous in its last dim, strides {logits.stride()}")
    t, e = logits.shape
    check_dim("logits", logits, 1, cfg.num_experts, "cfg.num_experts")
    require(
        e <= MAX_EXPERTS and cfg.top_k <= MAX_TOP_K,
        f"at most {MAX_EXPERTS} experts and top_k {MAX_TOP_K}, got {e} and {cfg.top_k}",
    )
    named = [("logits", logits)]
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, 1, _LOGIT_DTYPES)
        check_dim("correction_bias", correction_bias, 0, e, "the number of experts E = logits.shape[1]")
        named.append(("correction_bias", correction_bias))
    if live_rows is not None:
        check_tensor("live_rows", live_rows, 1, (torch.int64,))
        check_dim("live_rows", live_rows, 0, 1, "one count")
        named.append(("live_rows", live_rows))
    check_same_device(named)
    require(HAS_TRITON, "the Triton router needs the triton package, which is not installed")
    require(logits.is_cuda or triton_interpreting(), f"the Triton router needs CUDA tensors, got {logits.device}")
    k = cfg.top_k
    topk_ids = _out("topk_ids", topk_ids, (t, k), torch.int32, logits)
    topk_weights = _out("topk_weights", topk_weights, (t, k), torch.float32, logits)
    if t == 0:
        return topk_ids, topk_weights
    per_group = e // cfg.n_group
    g_pad, pg_pad = triton.next_power_of_2(cfg.n_group), triton.next_power_of_2(per_group)
    _k.router_kernel[(t,)](
        logits,
        correction_bias if correction_bias is not None else logits,
        topk_ids,
        topk_weights,
        live_rows if live_rows is not None else topk_ids,
        logits.stride(0),
        topk_ids.stride(0),
        topk_weights.stride(0),
        float(cfg.routed_scaling_factor),
        cfg.renorm_eps,
        E=e,
        K=k,
        K_PAD=triton.next_power_of_2(k),
        N_GROUP=cfg.n_group,
        PER_GROUP=per_group,
        TOPK_GROUP=cfg.topk_group,
        G_PAD=g_pad,
        PG_PAD=pg_pad,
        SIGMOID=cfg.scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None,
        RENORM=cfg.norm_topk_prob,
        HAS_LIVE=live_rows is not None,
        num_warps=1 if g_pad * pg_pad <= 128 else 2 if g_pad * pg_pad <= 512 else 4,
    )
    return topk_ids, topk_weights
