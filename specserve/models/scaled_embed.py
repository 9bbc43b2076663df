"""The demo's weights written into the wide model (Embedder; one decoder layer: embed_decoder_layer): corners of
the wide matrices, the scaled norms and the constant channel, the demo's heads and rope pairs, its experts among
the wide ones with the null-expert group and the choice biases, int4 experts as quantized blocks. Why each piece is
as it is: models/scaled_demo.py's docstring."""

from __future__ import annotations

import math

import torch

from specserve.models.causal_lm import CausalLM
from specserve.models.config import ModelConfig
from specserve.models.quant import Int4PackConfig
from specserve.models.scaled_int4 import quantize_int4
from specserve.models.scaled_shapes import constant_channel, demo_positions

CHOICE_BIAS = 1.0e4  # B: the choice bias that keeps an expert out (-B) or in (+2B) on a demo layer
NULL_LOGIT = 1.0e4  # a null expert's router weight on the constant channel (negated): sigmoid(-NULL_LOGIT * h) = 0


@torch.no_grad()
def embed_decoder_layer(wide_layer, demo_layer, demo: ModelConfig, wide: ModelConfig, channel: float) -> None:
    """One demo decoder layer written into a wide one of `wide`'s shape (scaled_demo.py's docstring: norms, attention, MoE routing
    with the null-expert group), for a residual stream whose dim H_demo holds `channel` (or any positive value that
    scales with it: the null experts' routers read channel dim / channel after the post-attention norm)."""
    Embedder(None, demo, None, wide, channel)._layer(wide_layer, demo_layer)


class Embedder:
    """Writes the demo's weights into the wide model (scaled_demo.py's docstring); one method per part."""

    def __init__(
        self,
        demo: CausalLM | None,
        dc: ModelConfig,
        wide: CausalLM | None,
        wc: ModelConfig,
        channel: float | None = None,
    ) -> None:
        self.demo, self.dc, self.wide, self.wc = demo, dc, wide, wc
        self.hd, self.hw = dc.hidden_size, wc.hidden_size
        self.kappa = constant_channel(dc, wc.hidden_size)[0] if channel is None else channel
        self.norm_scale = math.sqrt(self.hd / self.hw)

    def run(self) -> None:
        w = self.wide.model
        self.ends(w.embed_tokens.weight, self.wide.lm_head.weight, w.norm.weight)
        for i, layer in enumerate(w.layers):
            self.layer(i, layer)

    def ends(self, embed: torch.Tensor, head: torch.Tensor, norm: torch.Tensor) -> None:
        """The embedding table, the lm head and the final norm (all at full width)."""
        d, hd, vd = self.demo.model, self.hd, self.dc.vocab_size
        emb = embed.data
        emb[:vd].zero_()
        emb[:vd, :hd] = d.embed_tokens.weight.to(emb.dtype)
        emb[:, hd] = self.kappa  # the constant channel (rows past the demo's are never embedded: their logits are -inf)
        head = head.data
        head[:vd].zero_()
        head[:vd, :hd] = self.demo.lm_head.weight.to(head.dtype)
        self._residual_norm(norm, d.norm.weight, channel=0.0)

    def layer(self, i: int, layer) -> None:
        """Wide layer i (full width): a demo layer where demo_positions puts one, else a silent random layer."""
        positions = demo_positions(self.wc.num_layers, self.dc.num_layers)
        if i in positions:
            self._layer(layer, self.demo.model.layers[positions.index(i)])
        else:
            self._silence(layer)

    # -- pieces

    def _residual_norm(self, wide: torch.Tensor, demo: torch.Tensor, channel: float) -> None:
        wide.data.fill_(1.0)
        wide.data[: self.hd] = (demo.float() * self.norm_scale).to(wide.dtype)
        wide.data[self.hd] = channel

    @staticmethod
    def _latent_norm(wide: torch.Tensor, demo: torch.Tensor) -> None:
        wide.data.fill_(1.0)
        n = demo.shape[0]
        wide.data[:n] = (demo.float() * math.sqrt(n / wide.shape[0])).to(wide.dtype)

    @staticmethod
    def _corner(wide: torch.Tensor, demo: torch.Tensor, scale: float = 1.0) -> None:
        wide.data.zero_()
        wide.data[: demo.shape[0], : demo.shape[1]] = (demo.float() * scale).to(wide.dtype)

    @staticmethod
    def _rows(wide: torch.Tensor, demo: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
        """wide[dst, :C] = demo[src] * scale, everything else zero."""
        wide.data.zero_()
        wide.data[dst.to(wide.device), : demo.shape[1]] = (demo[src.to(demo.device)].float() * scale).to(wide.dtype)

    def _silence(self, layer) -> None:
        """A random layer that adds nothing: zero attention output and zero down projections."""
        layer.self_attn.o_proj.weight.data.zero_()
        mlp = layer.mlp
        if layer.is_moe:
            ex = mlp.experts
            (ex.w2_scale if hasattr(ex, "w2_scale") else ex.w2).data.zero_()
            if mlp.shared_experts is not None:
                mlp.shared_experts.down_proj.weight.data.zero_()
        else:
            mlp.down_proj.weight.data.zero_()

    def _layer(self, wl, dl) -> None:
        self._residual_norm(wl.input_layernorm.weight, dl.input_layernorm.weight, channel=0.0)
        # the null experts' routers read the channel after this norm: h = (1 / kappa) * kappa / rms = 1 / rms
        self._residual_norm(
            wl.post_attention_layernorm.weight, dl.post_attention_layernorm.weight, channel=1.0 / self.kappa
        )
        self._attention(wl.self_attn, dl.self_attn)
        if wl.is_moe:
            self._moe(wl.mlp, dl.mlp)
        else:
            self._mlp(wl.mlp, dl.mlp)

    def _attention(self, wa, da) -> None:
        d, w = self.dc.attention, self.wc.attention
        qk_d, qk_w = d.qk_head_dim, w.qk_head_dim
        rho = w.qk_rope_head_dim // d.qk_rope_head_dim
        # rope dims: demo pair i (dims 2i, 2i+1) -> wide pair rho * i
        pair = torch.arange(d.qk_rope_head_dim // 2)
        rope_dst = torch.stack([2 * rho * pair, 2 * rho * pair + 1], dim=1).flatten()
        rope_src = torch.arange(d.qk_rope_head_dim)
        heads = torch.arange(d.num_heads)[:, None]
        nope = torch.arange(d.qk_nope_head_dim)  # a head's nope dims are its first dims, at both widths
        q_src = torch.cat([(heads * qk_d + nope).flatten(), (heads * qk_d + d.qk_nope_head_dim + rope_src).flatten()])
        q_dst = torch.cat([(heads * qk_w + nope).flatten(), (heads * qk_w + w.qk_nope_head_dim + rope_dst).flatten()])
        q_scale = math.sqrt(qk_w / qk_d)  # the softmax scale is qk^-0.5
        self._corner(wa.q_a_proj.weight, da.q_a_proj.weight)
        self._latent_norm(wa.q_a_layernorm.weight, da.q_a_layernorm.weight)
        self._rows(wa.q_b_proj.weight, da.q_b_proj.weight, q_dst, q_src, q_scale)
        kv_src = torch.cat([torch.arange(d.kv_lora_rank), d.kv_lora_rank + rope_src])
        kv_dst = torch.cat([torch.arange(d.kv_lora_rank), w.kv_lora_rank + rope_dst])
        self._rows(wa.kv_a_proj_with_mqa.weight, da.kv_a_proj_with_mqa.weight, kv_dst, kv_src)
        self._latent_norm(wa.kv_a_layernorm.weight, da.kv_a_layernorm.weight)
        span_d, span_w = d.qk_nope_head_dim + d.v_head_dim, w.qk_nope_head_dim + w.v_head_dim
        v_d = torch.arange(d.v_head_dim)
        b_src = torch.cat([(heads * span_d + nope).flatten(), (heads * span_d + d.qk_nope_head_dim + v_d).flatten()])
        b_dst = torch.cat([(heads * span_w + nope).flatten(), (heads * span_w + w.qk_nope_head_dim + v_d).flatten()])
        self._rows(wa.kv_b_proj.weight, da.kv_b_proj.weight, b_dst, b_src)
        o_src = (heads * d.v_head_dim + v_d).flatten()
        o_dst = (heads * w.v_head_dim + v_d).flatten()
        o = wa.o_proj.weight.data
        o.zero_()
        o[: self.hd, o_dst.to(o.device)] = da.o_proj.weight[:, o_src.to(da.o_proj.weight.device)].to(o.dtype)

    def _mlp(self, wm, dm, scale: float = 1.0) -> None:
        """A gated MLP (dense, or shared experts) in the corner of its wide one."""
        self._corner(wm.gate_proj.weight, dm.gate_proj.weight)
        self._corner(wm.up_proj.weight, dm.up_proj.weight)
        self._corner(wm.down_proj.weight, dm.down_proj.weight, scale)

    def _moe(self, wm, dm) -> None:
        dcfg, wcfg = self.dc.moe, self.wc.moe
        per_d = dcfg.num_experts // dcfg.n_group
        per_w = wcfg.num_experts // wcfg.n_group
        demo_ids = torch.tensor([(e // per_d) * per_w + e % per_d for e in range(dcfg.num_experts)])
        null_ids = torch.arange(wcfg.top_k - dcfg.top_k) + dcfg.n_group * per_w
        router, bias = wm.gate.weight.data, wm.gate.e_score_correction_bias.data
        router[demo_ids.to(router.device)] = 0.0
        router[demo_ids.to(router.device), : self.hd] = dm.gate.weight.to(router.dtype)
        router[null_ids.to(router.device)] = 0.0
        router[null_ids.to(router.device), self.hd] = -NULL_LOGIT
        bias.fill_(-CHOICE_BIAS)
        bias[demo_ids.to(bias.device)] = dm.gate.e_score_correction_bias.to(bias.dtype)
        bias[null_ids.to(bias.device)] = 2 * CHOICE_BIAS
        down = dcfg.routed_scaling_factor / wcfg.routed_scaling_factor
        ex, dx = wm.experts, dm.experts
        quant = self.wc.quantization
        for e_d, e_w in enumerate(demo_ids.tolist()):
            gate, up = dx.w13[e_d, : dcfg.intermediate_size], dx.w13[e_d, dcfg.intermediate_size :]
            if isinstance(quant, Int4PackConfig):
                self._int4_expert(ex, e_w, gate, up, dx.w2[e_d].float() * down, quant.group_size)
            else:
                inter = ex.w13.shape[1] // 2
                ex.w13.data[e_w].zero_()
                ex.w13.data[e_w, : gate.shape[0], : self.hd] = gate.to(ex.w13.dtype)
                ex.w13.data[e_w, inter : inter + up.shape[0], : self.hd] = up.to(ex.w13.dtype)
                self._corner(ex.w2[e_w], dx.w2[e_d], down)
        for e_w in null_ids.tolist():
            (ex.w2_scale if isinstance(quant, Int4PackConfig) else ex.w2).data[e_w].zero_()
        if dm.shared_experts is not None:
            self._mlp(wm.shared_experts, dm.shared_experts)
        elif wm.shared_experts is not None:
            wm.shared_experts.down_proj.weight.data.zero_()

    def _int4_expert(self, ex, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group: int) -> None:
        """Expert e's int4 words and scales: the demo expert's quantized blocks in the corner, zero scales elsewhere."""
        inter = ex.w13.shape[1] // 2
        hd, gw = self.hd, self.hd // group
        ex.w13_scale.data[e].zero_()
        ex.w2_scale.data[e].zero_()
        for rows, w in ((0, gate), (inter, up)):
            packed, scale = quantize_int4(w, group)
            ex.w13.data[e, rows : rows + w.shape[0], : hd // 8] = packed.to(ex.w13.device)
            ex.w13_scale.data[e, rows : rows + w.shape[0], :gw] = scale.to(ex.w13_scale.device)
        packed, scale = quantize_int4(down, group)  # [H_d, I_d]
        ex.w2.data[e, :hd, : down.shape[1] // 8] = packed.to(ex.w2.device)
        ex.w2_scale.data[e, :hd, : down.shape[1] // group] = scale.to(ex.w2_scale.device)
