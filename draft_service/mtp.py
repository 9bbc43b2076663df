"""``mtp`` drafter: DeepSeek-V3's multi-token-prediction layer, read from the TARGET checkpoint itself, or
from a folder of its own beside a target that lacks it.

A checkpoint with ``num_nextn_predict_layers >= 1`` holds, past its N = ``num_hidden_layers`` decoder
layers, layer N: ``eh_proj.weight [H, 2H]``, ``enorm.weight``, ``hnorm.weight``,
``shared_head.norm.weight``, ``shared_head.head.weight [V, H]``, ``embed_tokens.weight [V, H]`` (copies
of the main embedding and head) and a full decoder block (MLA attention + MoE: the model library's own
``DecoderLayer``, loaded through the same weight names and loaders as the target).

A drafter folder (``DrafterConfig.checkpoint``; the shipped demo's ``mtp/``, made by ``specserve train
draft --family mtp``) holds that layer alone: a config.json naming it (the target's, with
``num_nextn_predict_layers`` >= 1) and the ``model.layers.N.*`` tensors under the same names. What it
leaves out of the layer's embedding and head (``embed_tokens``, ``shared_head.head``) is the target's
``model.embed_tokens.weight`` and ``lm_head.weight``, which DeepSeek-V3's MTP module shares; the target's
final norm is always the target's. One step:

    x = eh_proj(concat(enorm(embed(token)), hnorm(previous hidden)))      [T, H]
    h = block(x)                                                            over the drafter's own cache
    logits = shared_head.head(shared_head.norm(h))                          [T, V]

Alignment (as EAGLE-3): S = t_0 .. t_{L-1} (t_{L-1} the pending token) and the target gave rows h_0 ..
h_{L-2}. Entry j (0 <= j <= L-2) at position j reads token t_{j+1} and the target's final hidden state at
position j; its output at the pending token (entry L-2) gives drafted token 1. Drafted token i + 1 reads
(embed(d_i), the block's own output h at d_i) at position L-2+i: k > 1 by chaining.

The target's final hidden state is the main model's output, after its final norm (what its head
reads). The target hands out decoder-layer outputs before that norm, so the drafter asks for layer N - 1
and applies the target's ``model.norm.weight`` (read from the checkpoint) itself.

Cache: one paged cache (``PagedKVCache`` of one layer: the block's MLA latent entries, ``BlockManager``)
shared by the sessions. A session's entries are those of CONFIRMED positions (tokens of S with target
rows), then while drafting the drafted entries after them; each sync keeps the longest prefix of
confirmed entries whose tokens still match S and cuts the rest (the drafted ones always: their
previous hidden was the drafter's own, not the target's).

On CUDA (``DrafterConfig.graph_window`` > 0) chains run as CUDA graphs (mtp_graph.py): the catch-up feed of up to
max_block_size + 1 entries and the k drafted tokens in two replays, greedy or sampled; longer feeds (a prompt) run
eagerly first, and chains past the window stay eager, as do int4 / fp8 experts in float32.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from specserve.contract.types import DraftBlock
from specserve.draft_service.checkpoint_checks import checkpoint_vocab
from specserve.draft_service.drafter_config import DrafterConfig, DrafterInfo
from specserve.draft_service.drafter_errors import DrafterConfigError, ProposerError
from specserve.draft_service.drafting import draw_tokens, to_target_probs
from specserve.draft_service.graph_capture import capture_all_or_warn, use_norm_kernel
from specserve.draft_service.proposer import Proposer
from specserve.draft_service.session_state import ROLLBACK_ROWS, SessionState, common_prefix_len
from specserve.models import weight_names
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.block_manager import BlockManager, OutOfBlocks
from specserve.models.causal_lm import DecoderLayer
from specserve.models.checkpoint_slice import CheckpointSlice
from specserve.models.config import ModelConfig, ParallelConfig
from specserve.models.kv_cache import PagedKVCache
from specserve.models.layers import Embedding, ParallelLMHead, ReplicatedLinear, RMSNorm
from specserve.models.moe import StackedExperts, moe_reference
from specserve.models.scaled_shapes import is_scaled_demo

_OWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")  # layer N's tensors outside the block
_TARGET_NORM = "model.norm.weight"


@dataclass(frozen=True)
class MTPSpec:
    """Where the MTP layer is: the target's layer count N (the MTP layer is layer N) and the block's
    config (a one-layer ModelConfig whose layer 0 is layer N: MoE when layer N would be)."""

    num_target_layers: int
    block: ModelConfig

    @property
    def prefix(self) -> str:  # checkpoint name prefix of layer N
        return f"model.layers.{self.num_target_layers}."


def read_mtp_spec(target_dir: str | Path) -> MTPSpec:
    """The MTP layer of a target checkpoint; one line naming the problem when it has none."""
    path = Path(target_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DrafterConfigError(f"mtp reads the target's config.json: {path}: {e}") from e
    if not raw.get("num_nextn_predict_layers"):
        raise DrafterConfigError(
            f"target checkpoint {target_dir} has no multi-token-prediction layer (config.json num_nextn_predict_layers"
            f" is {raw.get('num_nextn_predict_layers')!r}); mtp needs one (DeepSeek-V3 / R1 checkpoints carry it)"
        )
    n = raw.get("num_hidden_layers")
    try:  # layer N's features (MoE or dense, attention kind) by the same rule as the target's layers
        full = ModelConfig.from_dict(dict(raw, num_hidden_layers=int(n) + 1))
    except Exception as e:
        raise DrafterConfigError(f"mtp: cannot read the target config {path}: {e}") from e
    moe = full.moe if full.moe is None else replace(full.moe, layers=(0,) if n in full.moe_layers else ())
    return MTPSpec(num_target_layers=n, block=replace(full, num_layers=1, moe=moe))


class MTPLayer(nn.Module):
    """Layer N's modules; parameter names are its checkpoint names less the ``model.layers.N.`` prefix
    (the block's under ``block.``), plus ``target_norm`` = the target's final norm (its eps the target's: ``target_eps``,
    the layer's own by default). Logits at or past ``cfg.logits_vocab_limit`` are -inf (a padded vocabulary)."""

    def __init__(self, cfg: ModelConfig, target_eps: float | None = None) -> None:
        super().__init__()
        h, v, eps, parallel = cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps, ParallelConfig()
        self.config, self.vocab_limit = cfg, cfg.logits_vocab_limit
        self.embed_tokens = Embedding(v, h)
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.block = DecoderLayer(cfg, 0, parallel, moe_reference)
        self.shared_head = nn.ModuleDict({"norm": RMSNorm(h, eps), "head": ParallelLMHead(h, v, parallel)})
        self.target_norm = RMSNorm(h, eps if target_eps is None else target_eps)

    def step(
        self,
        tokens: torch.Tensor,  # [T] int64: the token each entry reads
        previous: torch.Tensor,  # [T, H]: the hidden state before it (the target's final, or the block's own)
        positions: torch.Tensor,  # [T] int64
        attn: AttentionBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # [T, H] the block's output (chained into the next step; logits() of it)
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(tokens)), self.hnorm(previous)], dim=-1))
        return self.block(x, positions, attn, cache)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits = self.shared_head["head"](self.shared_head["norm"](h))
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit :] = float("-inf")  # in place: graph-safe
        return logits


def _param_for(name: str, spec: MTPSpec) -> weight_names.Target | None:
    """A checkpoint tensor -> the MTPLayer parameter it fills (None: not the MTP layer's)."""
    if name == _TARGET_NORM:
        return weight_names.Target("target_norm.weight")
    if not name.startswith(spec.prefix):
        return None
    rest = name[len(spec.prefix) :]
    if rest.split(".")[0] in _OWN:
        return weight_names.Target(rest)
    num_experts = spec.block.moe.num_experts if spec.block.moe else 0
    t = weight_names.resolve(f"model.layers.0.{rest}", 1, False, num_experts)  # the block as a layer 0
    return None if t is None else replace(t, param="block." + t.param[len("model.layers.0.") :])


def _checkpoint_name(param: str, piece, spec: MTPSpec) -> str:
    if param == "target_norm.weight":
        return _TARGET_NORM
    if param.startswith("block."):
        return weight_names.checkpoint_name(spec.prefix + param[len("block.") :], piece)
    return spec.prefix + param


# parameters a separate MTP folder may leave to the target -> the target's tensor (the head: its embedding when tied)
_SHARED = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
    "target_norm.weight": _TARGET_NORM,
}
_MATCH_TARGET = ("num_hidden_layers", "hidden_size", "vocab_size")  # config fields a folder must share with the target


def load_mtp_layer(
    target_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    layer_dir: str | Path | None = None,
) -> tuple[MTPLayer, MTPSpec]:
    """Layer N of the target checkpoint (and the target's final norm), or of ``layer_dir`` (a folder holding
    only that layer: the shared embedding, head and final norm come from the target), read tensor by
    tensor through the parameters' weight loaders; a missing or misshapen tensor is one DrafterConfigError
    naming it."""
    source = Path(layer_dir) if layer_dir is not None else Path(target_dir)
    spec = read_mtp_spec(source)
    if layer_dir is not None:
        _check_matches_target(source, Path(target_dir))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters start in dtype (the router's correction bias stays float32)
    try:
        with torch.device(device):
            layer = MTPLayer(spec.block)
    finally:
        torch.set_default_dtype(old)
    params = dict(layer.named_parameters())
    local = {
        f"{n}.{p}": m.local_experts()
        for n, m in layer.named_modules()
        if isinstance(m, StackedExperts)
        for p in ("w13", "w2")
    }
    needed = {n: weight_names.required_pieces(n, local.get(n)) for n in params}
    any_of_layer = _fill(
        source, lambda name: [t for t in (_param_for(name, spec),) if t is not None], params, needed, spec.prefix
    )
    if not any_of_layer:
        raise DrafterConfigError(  # config.json names the layer but no tensor of it is there (stripped)
            f"{'MTP folder' if layer_dir is not None else 'target checkpoint'} {source} says num_nextn_predict_layers"
            f" but holds no tensor of its multi-token-prediction layer ({spec.prefix}*); mtp needs a checkpoint that"
            " keeps that layer"
        )
    if layer_dir is not None:  # the shared tensors the folder left out, from the target
        tied = bool(
            json.loads((Path(target_dir) / "config.json").read_text(encoding="utf-8")).get("tie_word_embeddings")
        )
        sources = dict(_SHARED, **({"shared_head.head.weight": "model.embed_tokens.weight"} if tied else {}))
        wanted: dict[str, list[str]] = {}
        for param, name in sources.items():
            if needed[param]:
                wanted.setdefault(name, []).append(param)
        if wanted:
            _fill(
                Path(target_dir),
                lambda name: [weight_names.Target(p) for p in wanted.get(name, ())],
                params,
                needed,
                None,
            )
    missing = [_checkpoint_name(p, piece, spec) for p, pieces in needed.items() for piece in sorted(pieces, key=str)]
    if missing:
        shown = ", ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
        where = (
            f"MTP folder {source} (with target {target_dir})"
            if layer_dir is not None
            else f"target checkpoint {source}"
        )
        raise DrafterConfigError(f"{where} lacks MTP tensor(s): {shown}")
    return layer.eval(), spec


def _check_matches_target(layer_dir: Path, target_dir: Path) -> None:
    """An MTP folder is layer N of one target: it must agree with that target on N, hidden size and vocabulary."""
    try:
        mine = json.loads((layer_dir / "config.json").read_text(encoding="utf-8"))
        theirs = json.loads((target_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DrafterConfigError(f"mtp compares {layer_dir} with the target {target_dir}: {e}") from e
    bad = [f"{k} {mine.get(k)!r} vs {theirs.get(k)!r}" for k in _MATCH_TARGET if mine.get(k) != theirs.get(k)]
    if bad:
        raise DrafterConfigError(f"MTP folder {layer_dir} is not a layer of the target {target_dir}: {', '.join(bad)}")


def _fill(checkpoint: Path, targets_of, params: dict, needed: dict, layer_prefix: str | None) -> bool:
    """Load every tensor of ``checkpoint`` into the parameters ``targets_of(name)`` lists; returns whether any
    tensor name starts with ``layer_prefix``."""
    from specserve.models.loader import checkpoint_files

    try:
        files = checkpoint_files(str(checkpoint))
    except Exception as e:
        raise DrafterConfigError(f"mtp reads the checkpoint {checkpoint}: {e}") from e
    any_of_layer = False
    for file in files:
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers / short files
            raise DrafterConfigError(f"mtp: corrupt or unreadable safetensors file {file}: {e}") from e
        with handle as f:
            for name in f.keys():
                any_of_layer = any_of_layer or (layer_prefix is not None and name.startswith(layer_prefix))
                for target in targets_of(name):
                    param = params.get(target.param)
                    if param is None:
                        raise DrafterConfigError(
                            f"mtp: unexpected tensor {name} in {file} (no parameter {target.param})"
                        )
                    try:
                        param.weight_loader(param, CheckpointSlice.of(f.get_slice(name)), **target.kwargs)
                    except Exception as e:  # a shape that does not fit, or bytes that cannot be read
                        raise DrafterConfigError(
                            f"mtp: tensor {name} in {file} does not fit or cannot be read: {e}"
                        ) from e
                    needed[target.param].difference_update(target.pieces)
    return any_of_layer


@dataclass
class _MTPSession:
    key: object  # block-manager sequence id
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # S when last synced


class MTPProposer(Proposer):
    def __init__(self, layer: MTPLayer, spec: MTPSpec, config: DrafterConfig, vocab_hash: str) -> None:
        self.layer, self.spec = layer, spec
        self.device, self.dtype = torch.device(config.device), config.dtype
        self.blocks = BlockManager(config.kv_num_blocks, config.kv_block_size)
        self.cache = PagedKVCache(
            1, config.kv_num_blocks, config.kv_block_size, spec.block.kv_entry_shape, config.dtype, self.device
        )
        super().__init__(
            DrafterInfo(
                family="mtp",
                vocab_size=spec.block.vocab_size,
                vocab_hash=vocab_hash,
                max_block_size=config.max_block_size,
                needs_hidden_states=True,
                hidden_layers=(spec.num_target_layers - 1,),  # the last layer; target_norm makes it final
                has_probs=True,
                supports_tree=False,
            )
        )
        self.chain_graphs = None  # chains as CUDA graphs (mtp_graph.py), on CUDA
        why = self._graphs_unsupported(config)
        if not why:
            from specserve.models.attn_backend import triton_paged_unsupported

            attention = "paged_torch" if triton_paged_unsupported(spec.block, self.device) else "triton_paged"
            use_norm_kernel(self.layer)  # every RMSNorm one launch, eager and graphs alike (where triton is installed)
            graphs = self.build_chain_graphs(config.graph_window, config.max_block_size, attention)
            self.chain_graphs = capture_all_or_warn(graphs, "mtp drafter chains")
        elif self.device.type == "cuda" and config.graph_window > 0:
            warnings.warn(f"mtp drafter chains run eager: {why}", RuntimeWarning, stacklevel=2)

    def _graphs_unsupported(self, config: DrafterConfig) -> str:
        """Why chains cannot run as CUDA graphs here ('' when they can)."""
        from specserve.models.attn_backend import paged_torch_unsupported
        from specserve.models.backends import fused_moe_unsupported

        if self.device.type != "cuda":
            return f"device {self.device} is not CUDA"
        if config.graph_window <= 0:
            return "graph_window is 0"
        packed = self.layer.block.is_moe and type(self.layer.block.mlp.experts) is not StackedExperts
        if packed and fused_moe_unsupported(self.device, self.dtype):
            return f"quantized experts in {self.dtype} (their graph-safe kernels take bf16 / fp16)"
        return paged_torch_unsupported(self.spec.block)

    def build_chain_graphs(self, window: int, k_max: int, attention: str = "paged_torch"):
        """The chain graphs' buffers over this drafter's layer and cache, not captured yet (mtp_graph.py; on a CPU
        their bodies run eagerly: tests check them there)."""
        from specserve.draft_service.mtp_graph import MTPChainGraphs

        bs = self.blocks.block_size
        window = min(window, self.cache.num_blocks * bs)
        window = max(
            window // bs * bs, -(-(k_max + 1) // bs) * bs
        )  # whole blocks; a feed holds up to k_max + 1 entries
        return MTPChainGraphs(
            self.layer, self.cache, bs, window, self.spec.block.vocab_size, k_max, k_max + 1, attention
        )

    def _hidden_width(self) -> int:
        return self.spec.block.hidden_size

    def _start_state(self, state: SessionState) -> None:
        fs = _MTPSession(key=object())
        self.blocks.add(fs.key, 0)
        state.family_state = fs

    def _release_state(self, state: SessionState) -> None:
        self.blocks.free(state.family_state.key)

    def _run(self, fs: _MTPSession, tokens: torch.Tensor, previous: torch.Tensor, start: int) -> torch.Tensor:
        """Entries start .. start + T - 1 (causal, after the session's first ``start``) -> [T, H]."""
        n = len(tokens)
        try:
            table = self.blocks.grow(fs.key, start + n)
        except OutOfBlocks as e:
            self.blocks.truncate(fs.key, start)
            raise ProposerError(f"mtp drafter KV cache is full: {e}") from e
        attn = AttentionBatch.contiguous([n], [start], [table], self.blocks.block_size)
        pos = torch.arange(start, start + n, device=self.device)
        return self.layer.step(tokens.to(self.device), previous, pos, attn, self.cache)

    def _catch_up(self, state: SessionState) -> torch.Tensor:
        """Sync the session's entries to S; returns the block's output at the pending token [H]."""
        fs: _MTPSession = state.family_state
        ids, L = state.ids, len(state)
        keep = max(0, min(common_prefix_len(fs.tokens, ids) - 1, L - 2))  # entry j needs t_0 .. t_{j+1}
        self.blocks.truncate(fs.key, keep)
        rows = state.hidden_rows(keep, L - 1).to(self.device, self.dtype)  # [L - 1 - keep, H]
        out = self._run(fs, torch.as_tensor(ids[keep + 1 : L]), self.layer.target_norm(rows), keep)
        fs.tokens = ids[:L].copy()
        state.drop_hidden_before(L - 1 - ROLLBACK_ROWS)
        return out[-1]

    @torch.inference_mode()
    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        if len(state) < 2:  # no target row yet
            return DraftBlock(token_ids=())
        graphs = self.chain_graphs
        if graphs is not None and graphs.fits(len(state), num_tokens):
            return self._draft_chain_graphs(state, num_tokens)
        fs: _MTPSession = state.family_state
        h = self._catch_up(state)
        base = len(state) - 2  # the pending token's entry
        drafted, qs = [], []
        for i in range(num_tokens):
            tok, q = draw_tokens(self.layer.logits(h[None]), state.sampling, state.generator)  # [1], [1, V]
            drafted.append(int(tok[0]))
            if q is not None:
                qs.append(q)
            if i < num_tokens - 1:  # drafted token i + 2 reads (embed(d_{i+1}), the block's output h)
                h = self._run(fs, tok, h[None], base + 1 + i)[0]
        probs = None if not qs else to_target_probs(torch.cat(qs), self.spec.block.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs)

    def _draft_chain_graphs(self, state: SessionState, num_tokens: int) -> DraftBlock:
        """The same chain through mtp_graph.py: the catch-up feed (one replay; a long one several, feed_max entries
        each), then the k draws in one replay; the cache then holds the confirmed entries and the first k - 1 drafted
        ones, as after the eager chain."""
        fs: _MTPSession = state.family_state
        graphs, ids, L = self.chain_graphs, state.ids, len(state)
        keep = max(0, min(common_prefix_len(fs.tokens, ids) - 1, L - 2))
        self.blocks.truncate(fs.key, keep)
        try:
            table = self.blocks.grow(fs.key, L - 2 + num_tokens)  # entries up to base + k - 1
        except OutOfBlocks as e:
            self.blocks.truncate(fs.key, keep)
            raise ProposerError(f"mtp drafter KV cache is full: {e}") from e
        rows = state.hidden_rows(keep, L - 1).to(self.device, self.dtype)  # [L - 1 - keep, H]
        while L - 1 - keep > graphs.feed_max:  # a long catch-up: feed replays of feed_max entries, then the rest's
            m = graphs.feed_max
            graphs.feed(table, L - 2, ids[keep + 1 : keep + 1 + m].copy(), rows[:m], keep)
            keep, rows = keep + m, rows[m:]
        drafted, q = graphs.draft(
            table, L - 2, num_tokens, state.sampling, state.generator, (ids[keep + 1 : L].copy(), rows, keep)
        )
        fs.tokens = ids[:L].copy()
        state.drop_hidden_before(L - 1 - ROLLBACK_ROWS)
        probs = None if q is None else to_target_probs(q, self.spec.block.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs)


def build_mtp_proposer(config: DrafterConfig) -> MTPProposer:
    """Registry factory: the MTP layer of ``config.target_checkpoint``, or of ``config.checkpoint`` (a folder
    holding only that layer, e.g. the shipped demo's ``mtp/``) read beside that target; with a demo@ target, that
    folder's demo-size layer built at the target's size (models/scaled_mtp.py)."""
    target = config.target_checkpoint
    if target is None:
        raise DrafterConfigError("mtp reads the multi-token-prediction layer of the target: give the target checkpoint")
    if config.hidden_layers is not None:
        raise DrafterConfigError(
            "mtp reads the target's last layer (through its final norm); hidden_layers cannot be set"
        )
    folder = config.checkpoint
    if is_scaled_demo(target):  # the demo's MTP layer at the demo@ target's size (models/scaled_mtp.py)
        from specserve.draft_service.checkpoint_checks import scaled_drafter, target_name, target_vocab
        from specserve.models.scaled_mtp import scaled_mtp_layer

        if folder is None:
            raise DrafterConfigError(f"mtp with {target} scales the demo's MTP layer: give its folder (demo_model/mtp)")
        name = target_name(target)
        demo, demo_spec = load_mtp_layer(name.folder, config.device, torch.float32, layer_dir=folder)
        layer, spec = scaled_drafter(
            lambda: scaled_mtp_layer(demo, demo_spec, folder, name, config.device, config.dtype)
        )
        return MTPProposer(layer, spec, config, target_vocab(target).hash)
    if folder is not None and Path(folder).resolve() == Path(target).resolve():
        folder = None  # the target's own layer
    if folder is not None and not (Path(folder) / "config.json").is_file():
        raise DrafterConfigError(f"no MTP folder (config.json) at {folder}")
    if folder is not None and not (Path(target) / "config.json").is_file():  # e.g. a demo@ name, built at load time
        raise DrafterConfigError(
            f"the MTP folder {folder} is layer N of a target checkpoint folder; {target} is not one"
        )
    layer, spec = load_mtp_layer(target, config.device, config.dtype, layer_dir=folder)
    _, vocab_hash = checkpoint_vocab(target)
    return MTPProposer(layer, spec, config, vocab_hash)
