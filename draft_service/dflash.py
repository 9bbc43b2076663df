"""DFlash-style block drafter: fills a block of b positions in ONE forward pass (or a few, see
"Denoising passes").

Model. Target hidden rows (a few layers, concatenated) are fused by ``fc`` and normed into one context
vector per position; every draft layer projects those context vectors to its own K/V (rope at their
positions). The block's queries are [embed(pending token), mask, mask, ...] at positions L-1 .. L+b-2;
inside the block attention is NON-causal, and every block query sees the whole context. Output i gives
the logits of drafted token i + 1, so drafting k <= b tokens is one forward of b queries.

Denoising passes (``denoise_steps: S`` in config.json; absent = 1). A block can also take known tokens
in place of masks: ``block_logits(..., given=[g_1..g_m])`` puts embed(g_j) at block position j (1 <= j
<= m). With S > 1 (or ``DrafterConfig.denoise_steps``, which overrides it at serve time) the
proposer drafts in min(S, k) passes over the same context: each pass but the
last fixes the next drafted token (from that pass's logits, given the tokens fixed before it), the
last pass fixes all the rest. Token 2 is then drafted knowing token 1, as in an autoregressive
drafter, at the cost of one more pass over b queries. The trainer sets S = 1 + the most given tokens
it trained with (``--arch given_tokens``).

Sampling. Each drafted token is drawn from its own q_i (the request's sampling transform of logits i of
the pass that fixed it); that pass saw exactly the tokens drawn before it that were fixed earlier, and
q_i does not depend on the others, so q_i IS the distribution token i was drawn from given the tokens
before it, which is what the target's lossless rule needs.

Checkpoint layout (``save_dflash`` / ``load_dflash``): ``config.json`` with ``model_type: "dflash"``,
hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
rms_norm_eps, rope_theta, vocab_size (the target's), block_size, target_hidden_size,
target_layer_ids (our capture convention: output of target decoder layer i); ``model.safetensors`` with
``embed_tokens.weight [V, H]``, ``mask_embedding [H]``, ``fc.weight [H, n_layers * Ht]``,
``context_norm.weight [H]``, ``layers.{i}.input_layernorm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight [V, H]``.

Shared target head (``shared_target_head: true`` in config.json; absent = false, the original layout):
as in the published DFlash design the drafter reads the TARGET's ``model.embed_tokens.weight`` and
``lm_head.weight`` (its embeddings when the target ties them) instead of its own; hidden_size must then
equal target_hidden_size. Those two tensors are frozen, not in model.safetensors, and are filled from
the target checkpoint at load (which is then required). The final ``norm`` stays the drafter's own.

z-lab's published layout (``architectures: ["DFlashDraftModel"]``) is read as is: dflash_config.py
says how it maps onto DFlashConfig's features; the model and the proposer are the same for both.

Session cache: per layer the K/V of the context rows of CONFIRMED positions (tokens of S with target
rows), extended in place by the rows each propose adds (the accepted tokens and the old pending one), never
recomputed; rollback keeps the longest prefix whose tokens still match S.

On CUDA (``DrafterConfig.graph_window`` > 0) a propose is two replays (dflash_graph.py) over a window of that many
context rows: the new rows' context K/V (one graph per row count, 1..max_block_size + 1), then the block's passes
(one graph per block length, greedy or sampled); a longer extension (a prompt) runs eagerly, a longer context drafts
eagerly.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.contract.types import DraftBlock
from specserve.draft_service.checkpoint_checks import scaled_drafter, target_name, target_vocab
from specserve.draft_service.dflash_config import DFlashConfig, read_config
from specserve.draft_service.drafter_config import DrafterConfig, DrafterInfo
from specserve.draft_service.drafter_errors import DrafterConfigError, VocabMismatchError
from specserve.draft_service.drafting import draw_tokens, to_target_probs
from specserve.draft_service.graph_capture import capture_all_or_warn, use_norm_kernel
from specserve.draft_service.proposer import Proposer
from specserve.draft_service.session_state import ROLLBACK_ROWS, SessionState, common_prefix_len
from specserve.draft_service.target_tensors import read_target_tensors, read_tensors
from specserve.models.attention import attend
from specserve.models.config import RopeConfig
from specserve.models.layers import RMSNorm
from specserve.models.rope import RotaryEmbedding

WEIGHTS_FILE = "model.safetensors"


def _norm(size: int, eps: float) -> RMSNorm:
    norm = RMSNorm(size, eps)
    nn.init.ones_(norm.weight)
    return norm


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.input_layernorm = _norm(h, c.rms_norm_eps)
        self.post_attention_layernorm = _norm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        if c.qk_norm:
            self.q_norm = _norm(d, c.rms_norm_eps)
            self.k_norm = _norm(d, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)


class DFlashModel(nn.Module):
    """Parameters start random; with ``shared_target_head`` embed_tokens and lm_head are frozen
    (requires_grad False) and hold the target's tensors once loaded or built by the trainer."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if cfg.mask_token_id is None:  # else the mask is the (target's) embedding of mask_token_id
            self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.context_norm = _norm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _norm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(RopeConfig(rope_type="default", theta=cfg.rope_theta, dim=cfg.head_dim))
        if cfg.shared_target_head:  # the target's tensors (filled by the loader / trainer), never trained
            self.embed_tokens.weight.requires_grad_(False)
            self.lm_head.weight.requires_grad_(False)

    def _kv(self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, t = self.cfg, x.shape[0]
        h = layer.input_layernorm(x) if c.context_layernorm else x
        k = layer.k_proj(h).view(t, c.num_key_value_heads, c.head_dim)
        v = layer.v_proj(h).view(t, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            k = layer.k_norm(k)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        return RotaryEmbedding.apply(k, cos, sin, interleaved=False), v

    def _block_input(self, known: torch.Tensor) -> torch.Tensor:  # [1 + m] known tokens -> [b, H]
        b = self.cfg.block_size
        if self.cfg.mask_token_id is not None:
            return self.embed_tokens(F.pad(known, (0, b - len(known)), value=self.cfg.mask_token_id))
        return torch.cat([self.embed_tokens(known), self.mask_embedding[None].expand(b - len(known), -1)])

    def context_kv(self, feats: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """feats [T, n_layers * Ht], pos [T] -> per draft layer (k, v), each [T, Hkv, D]."""
        ctx = self.context_norm(self.fc(feats.to(self.fc.weight.dtype)))
        return [self._kv(layer, ctx, pos) for layer in self.layers]

    def block_logits(
        self,
        first_token: torch.Tensor,  # [1] int64, the pending token
        first_pos: int | torch.Tensor,  # its position (an int, or a 0-dim int64 device tensor inside a CUDA graph)
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer ([P, Hkv, D], [P, Hkv, D])
        ctx_mask: torch.Tensor | None = None,  # [b, P] bool; None = every block query sees all context
        given: torch.Tensor | None = None,  # [m] int64 known tokens at block positions 1..m (m <= b - 1)
    ) -> torch.Tensor:  # [cfg.drafts_per_block, V] float32: logits of drafted tokens 1, 2, ...
        return self.head_logits(self.block_hidden(first_token, first_pos, ctx_kv, ctx_mask, given))

    def head_logits(self, z: torch.Tensor) -> torch.Tensor:  # [N, H] final-normed rows -> [N, V] float32
        """The output head over final-normed rows: lm_head, logits past ``logits_vocab_limit`` at -inf."""
        logits = self.lm_head(z).float()
        limit = self.cfg.logits_vocab_limit
        if limit is not None and limit < logits.shape[-1]:
            logits[:, limit:] = float("-inf")  # in place: graph-safe
        return logits

    def block_hidden(
        self,
        first_token: torch.Tensor,  # [1] int64, the pending token
        first_pos: int | torch.Tensor,  # its position (int, or 0-dim int64 device tensor)
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],  # per layer ([P, Hkv, D], [P, Hkv, D])
        ctx_mask: torch.Tensor | None = None,  # [b, P] bool
        given: torch.Tensor | None = None,  # [m] int64
    ) -> torch.Tensor:  # [cfg.drafts_per_block, H]: the final-normed rows of drafted tokens 1, 2, ...
        """block_logits' rows before the output head (the arguments are block_logits')."""
        c, b = self.cfg, self.cfg.block_size
        known = first_token if given is None else torch.cat([first_token, given])  # [1 + m]
        if len(known) > b:
            raise ValueError(f"{len(known) - 1} given tokens do not fit a block of {b}")
        x = self._block_input(known)  # [b, H]
        pos = first_pos + torch.arange(b, device=x.device)  # [b]
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        p = ctx_kv[0][0].shape[0]
        mask = torch.ones(b, p + b, dtype=torch.bool, device=x.device)
        if ctx_mask is not None:
            mask[:, :p] = ctx_mask
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer.input_layernorm(x)
            q = layer.q_proj(h).view(b, c.num_attention_heads, c.head_dim)
            k = layer.k_proj(h).view(b, c.num_key_value_heads, c.head_dim)
            if c.qk_norm:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = RotaryEmbedding.apply(q, cos, sin, False), RotaryEmbedding.apply(k, cos, sin, False)
            v = layer.v_proj(h).view(b, c.num_key_value_heads, c.head_dim)
            out = attend(q, torch.cat([ck, k]), torch.cat([cv, v]), mask, c.head_dim**-0.5)
            x = x + layer.o_proj(out.reshape(b, -1))
            y = layer.post_attention_layernorm(x)
            x = x + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
        z = self.norm(x)  # [b, H]
        return z if c.anchor_predicts_next else z[1:]


SHARED_TENSORS = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def _saved_names(cfg: DFlashConfig, state_names) -> list[str]:
    """Module attribute paths that model.safetensors holds (all but the shared target head, if shared)."""
    return [k for k in state_names if not (cfg.shared_target_head and k in SHARED_TENSORS)]


def dflash_tensors(model: DFlashModel) -> dict[str, torch.Tensor]:
    """The tensors model.safetensors holds, by checkpoint name (CPU, contiguous)."""
    state = model.state_dict()
    return {_ckpt_name(k): state[k].detach().contiguous().cpu() for k in _saved_names(model.cfg, state)}


def save_dflash(model: DFlashModel, out_dir: str | Path) -> None:
    """Write config.json + model.safetensors (the layout in the module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dflash_tensors(model), str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))


def _ckpt_name(attr: str, renames: dict[str, str] | None = None) -> str:
    """Module attribute path -> checkpoint name (attention / MLP projections get HF-style groups;
    ``renames`` are the layout's own names, e.g. ZLAB_RENAMES)."""
    if renames and attr in renames:
        return renames[attr]
    parts = attr.split(".")
    if parts[0] == "layers" and parts[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        return ".".join(parts[:2] + ["self_attn"] + parts[2:])
    if parts[0] == "layers" and parts[2] in ("gate_proj", "up_proj", "down_proj"):
        return ".".join(parts[:2] + ["mlp"] + parts[2:])
    return attr


def read_target_head(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """The target checkpoint's token embeddings and output head: {"embed_tokens.weight": [V, Ht],
    "lm_head.weight": [V, Ht]} (the embeddings again when the target ties them)."""
    from specserve.models.config import ModelConfig

    try:
        tied = ModelConfig.from_file(str(target_dir)).tie_word_embeddings
    except Exception as e:
        raise DrafterConfigError(
            f"dflash shares the target's embeddings and lm_head, but the target {target_dir}: {e}"
        ) from e
    names = {k: v for k, v in SHARED_TENSORS.items() if not (tied and k == "lm_head.weight")}
    found = read_target_tensors(target_dir, names, "dflash shared_target_head")
    if tied:
        found["lm_head.weight"] = found["embed_tokens.weight"]
    return found


def load_dflash(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    target_dir: str | Path | None = None,  # required when the checkpoint has shared_target_head
) -> DFlashModel:
    path = Path(path)
    cfg, renames = read_config(read_config_json(path, "dflash"))
    return load_block(cfg, renames, path, device, dtype, target_dir)


def read_config_json(path: Path, what: str) -> dict:
    """config.json of a drafter folder; a missing or malformed one is a DrafterConfigError naming it."""
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DrafterConfigError(f"{what}: no config.json in {path}") from e
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"{what}: {path / 'config.json'} is not valid JSON: {e}") from e


def load_block(
    cfg: DFlashConfig,
    renames: dict[str, str],
    path: Path,
    device: str | torch.device,
    dtype: torch.dtype,
    target_dir: str | Path | None,
) -> DFlashModel:
    """A DFlashModel of ``cfg`` with the tensors of path/model.safetensors (and the target's head when shared)."""
    if not (path / WEIGHTS_FILE).is_file():
        raise DrafterConfigError(f"dflash: no {WEIGHTS_FILE} in {path}")
    shared = {}
    if cfg.shared_target_head:
        if target_dir is None:
            raise DrafterConfigError(
                f"dflash checkpoint {path} has shared_target_head (as z-lab's layout does): it reads the target's"
                " embed_tokens and lm_head; give the target checkpoint (target_checkpoint) to load it"
            )
        shared = read_target_head(target_dir)
    with torch.device(device):
        model = DFlashModel(cfg)
    state = model.state_dict()
    saved = {attr: _ckpt_name(attr, renames) for attr in _saved_names(cfg, state)}
    tensors = read_tensors(path / WEIGHTS_FILE, "dflash", saved.values())
    for attr, name in saved.items():
        if name not in tensors:
            raise DrafterConfigError(f"dflash checkpoint {path} lacks tensor {name}")
        copy_checked(state[attr], tensors[name], f"dflash tensor {name}")
    for attr, src in shared.items():
        copy_checked(state[attr], src, f"target tensor {SHARED_TENSORS[attr]} (of {target_dir})")
    return model.to(dtype=dtype).eval()


def copy_checked(param: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise DrafterConfigError(f"{what} has shape {tuple(src.shape)}, expected {tuple(param.shape)}")
    param.copy_(src)


@dataclass
class _DFlashSession:
    """Per layer the context K/V of the session's confirmed positions, rows [0, rows) of buffers that grow by
    doubling: a propose writes its new rows in place (no copy of the older ones)."""

    keys: list[torch.Tensor]  # per layer [capacity, Hkv, D]
    values: list[torch.Tensor]  # per layer [capacity, Hkv, D]
    rows: int = 0
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [rows] their tokens
    window_rows: int = 0  # rows unchanged since the graph window last held this session's (dflash_graph.py)

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per layer ([rows, Hkv, D], [rows, Hkv, D]) views
        return [(k[: self.rows], v[: self.rows]) for k, v in zip(self.keys, self.values)]

    def write(self, start: int, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Rows start.. of every layer := new (per layer ([n, Hkv, D], [n, Hkv, D])); rows = start + n."""
        end = start + new[0][0].shape[0]
        if end > self.keys[0].shape[0]:
            cap = max(end, 2 * self.keys[0].shape[0])
            for buffers in (self.keys, self.values):
                for i, old in enumerate(buffers):
                    grown = old.new_zeros((cap, *old.shape[1:]))
                    grown[:start] = old[:start]
                    buffers[i] = grown
        for (nk, nv), k, v in zip(new, self.keys, self.values):
            k[start:end] = nk
            v[start:end] = nv
        self.rows = end


class DFlashProposer(Proposer):
    FAMILY = "dflash"  # DrafterInfo.family (dspark.py's proposer is this one with its own drafting)

    def __init__(
        self, model: DFlashModel, config: DrafterConfig, hidden_layers: tuple[int, ...], vocab_hash: str
    ) -> None:
        self.model = model
        # passes per block (module docstring); a serve-time override goes through DFlashConfig's checks
        self.passes = replace(model.cfg, denoise_steps=config.denoise_steps or model.cfg.denoise_steps).denoise_steps
        self.device = torch.device(config.device)
        self.vocab_size = model.cfg.vocab_size
        self.block_graphs = None  # a block's passes as CUDA graphs (dflash_graph.py), on CUDA
        if self.device.type == "cuda" and config.graph_window > 0:
            self.block_graphs = self._capture_graphs(config)
        super().__init__(
            DrafterInfo(
                family=self.FAMILY,
                vocab_size=self.vocab_size,
                vocab_hash=vocab_hash,
                max_block_size=min(config.max_block_size, model.cfg.drafts_per_block),
                needs_hidden_states=True,
                hidden_layers=hidden_layers,
                has_probs=True,
                supports_tree=False,
            )
        )

    def build_block_graphs(self, window: int, k_max: int):
        """The block graphs' buffers over this drafter's model, not captured yet (dflash_graph.py; on a CPU their
        passes run eagerly: tests check them there)."""
        from specserve.draft_service.dflash_graph import DFlashBlockGraphs

        return DFlashBlockGraphs(self.model, window, min(k_max, self.model.cfg.drafts_per_block), self.passes)

    def _capture_graphs(self, config: DrafterConfig):
        use_norm_kernel(self.model)
        graphs = self.build_block_graphs(config.graph_window, config.max_block_size)
        return capture_all_or_warn(graphs, "dflash blocks")

    def _hidden_width(self) -> int:
        return len(self.model.cfg.target_layer_ids) * self.model.cfg.target_hidden_size

    def _start_state(self, state: SessionState) -> None:
        c = self.model.cfg
        cap = max(64, 2 * len(state))

        def empty() -> torch.Tensor:
            return torch.zeros(
                cap, c.num_key_value_heads, c.head_dim, dtype=self.model.fc.weight.dtype, device=self.device
            )

        layers = range(c.num_hidden_layers)
        state.family_state = _DFlashSession(keys=[empty() for _ in layers], values=[empty() for _ in layers])

    @torch.inference_mode()
    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        fs: _DFlashSession = state.family_state
        ids, L = state.ids, len(state)
        keep = min(common_prefix_len(fs.tokens, ids), L - 1)
        n = L - 1 - keep  # context rows for positions keep .. L-2 are new
        fs.rows, same = keep, min(fs.window_rows, keep)  # rows the window may still hold
        feats = state.hidden_rows(keep, L - 1).to(self.device) if n else None
        graphs = self.block_graphs
        on_graphs = graphs is not None and graphs.fits(L - 1, num_tokens)
        if on_graphs and graphs.extends(n):  # the new rows' K/V in one replay, straight into the window
            graphs.load(fs, fs.kv, same, keep)
            graphs.stage(keep, L - 1, int(ids[L - 1]))
            fs.write(keep, graphs.extend(keep, feats))
        else:
            if n:
                fs.write(keep, self.model.context_kv(feats, torch.arange(keep, L - 1, device=self.device)))
            if on_graphs:
                graphs.load(fs, fs.kv, same, L - 1)
                graphs.stage(keep, L - 1, int(ids[L - 1]))
        fs.tokens = ids[: L - 1].copy()
        fs.window_rows = L - 1 if on_graphs else min(fs.window_rows, keep)
        state.drop_hidden_before(L - 1 - ROLLBACK_ROWS)
        return self._graph_block(state, num_tokens) if on_graphs else self._eager_block(state, num_tokens)

    def _graph_block(self, state: SessionState, num_tokens: int) -> DraftBlock:
        """The block's passes as graph replays, after the context is in the window."""
        drafted, q = self.block_graphs.draft(num_tokens, state.sampling, state.generator)
        probs = None if q is None else to_target_probs(q, self.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs)

    def _eager_block(self, state: SessionState, num_tokens: int) -> DraftBlock:
        """The block's passes eagerly over the session's context K/V."""
        fs: _DFlashSession = state.family_state
        L = len(state)
        first = torch.as_tensor(state.ids[L - 1 : L], device=self.device)
        kv = fs.kv
        passes = min(self.passes, num_tokens)
        tokens, qs = first.new_zeros(0), []
        for step in range(passes):  # each pass but the last fixes one more token (module docstring)
            logits = self.model.block_logits(first, L - 1, kv, given=tokens)  # [b, V]
            end = len(tokens) + 1 if step < passes - 1 else num_tokens
            new, q = draw_tokens(logits[len(tokens) : end], state.sampling, state.generator)
            tokens = torch.cat([tokens, new])
            qs.append(q)
        probs = None if qs[0] is None else to_target_probs(torch.cat(qs), self.vocab_size)
        return DraftBlock(token_ids=tuple(int(t) for t in tokens.tolist()), probs=probs)


def build_dflash_proposer(config: DrafterConfig) -> DFlashProposer:
    model = load_block_drafter(config, "dflash", load_dflash, "specserve.models.scaled_drafters:scaled_dflash")
    return DFlashProposer(model, config, *block_identity(model.cfg, config, "dflash"))


def load_block_drafter(config: DrafterConfig, family: str, load, scaler: str):
    """The model of a block drafter's folder (DFlash, DSpark): ``load(path, device, dtype, target_dir)`` as it is, or
    for a demo@ target its demo-size model scaled to the target by ``scaler`` ("module:function", imported only then:
    models/scaled_drafters.py, scaled_dspark.py; a drafter that does not scale is a DrafterConfigError)."""
    if config.checkpoint is None:
        raise DrafterConfigError(f"{family} needs checkpoint = the {family} drafter folder")
    name = target_name(config.target_checkpoint) if config.target_checkpoint is not None else None
    if name is None or not name.scaled:
        return load(config.checkpoint, config.device, config.dtype, config.target_checkpoint)
    module, function = scaler.split(":")
    scale = getattr(importlib.import_module(module), function)
    demo = load(config.checkpoint, "cpu", torch.float32, name.folder)
    return scaled_drafter(lambda: scale(demo, config.checkpoint, name, config.device, config.dtype))


def block_identity(cfg: DFlashConfig, config: DrafterConfig, family: str) -> tuple[tuple[int, ...], str]:
    """(the target layers a block drafter reads, its vocab hash), its vocabulary checked against the target's."""
    vocab_hash = f"size:{cfg.vocab_size}"
    if config.target_checkpoint is not None:
        vocab = target_vocab(config.target_checkpoint)
        vocab_hash = vocab.hash
        if vocab.size != cfg.vocab_size:
            raise VocabMismatchError(f"{family} vocab_size {cfg.vocab_size} != target vocab_size {vocab.size}")
    layers = config.hidden_layers or cfg.target_layer_ids
    if len(layers) != len(cfg.target_layer_ids):
        raise DrafterConfigError(f"{family} was trained on {len(cfg.target_layer_ids)} target layers, got {layers}")
    return tuple(layers), vocab_hash
