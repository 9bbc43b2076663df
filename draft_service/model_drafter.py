"""``model`` drafter: an independent small causal LM (any architecture the target code loads, dense or
MoE) with its own paged KV cache, drafting autoregressively (chains) or EAGLE-2 dynamic trees.

It reuses the target's model code (``models/loader.load_model``), paged cache (``PagedKVCache``),
block manager and attention metadata, so it runs exactly the arithmetic the target would.

Cache sync: per session the cache holds the K/V of ``kv_tokens`` (a prefix of S, possibly followed by
the drafted tokens it fed while drafting). Each propose keeps the longest prefix of ``kv_tokens`` that
still matches S (accepted drafted tokens are kept for free; the pending token is always re-fed to get
its logits), truncates the block table there and feeds the rest.

Tree levels are fed WITHOUT writing the cache (slot -1): the nodes to expand and their ancestors go in
as new tokens under a tree mask, on top of S's cached context.

On CUDA (``DrafterConfig.graph_window`` > 0, a dense draft LM without sliding-window attention) chains run as CUDA
graphs (model_graph.py: the Triton paged attention and the fused layers where triton is installed, else the paged
torch attention): the catch-up feed of up to max_block_size + 1 tokens and the k drafted tokens in two replays, greedy
or sampled; longer feeds (a prompt) run eagerly first. Trees, and chains past the window, stay eager.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.contract.types import DraftBlock, TreeSpec
from specserve.draft_service.checkpoint_checks import check_same_vocab, checkpoint_vocab, scaled_drafter, target_name
from specserve.draft_service.drafter_config import DrafterConfig, DrafterInfo
from specserve.draft_service.drafter_errors import DrafterConfigError, ProposerError
from specserve.draft_service.drafting import draw_tokens, to_target_probs
from specserve.draft_service.graph_capture import capture_all_or_warn
from specserve.draft_service.proposer import Proposer
from specserve.draft_service.session_state import SessionState, common_prefix_len
from specserve.draft_service.tree import build_tree
from specserve.models.attn_backend import paged_torch_unsupported
from specserve.models.attn_metadata import AttentionBatch
from specserve.models.block_manager import BlockManager, OutOfBlocks
from specserve.models.kv_cache import PagedKVCache


@dataclass
class _ModelSession:
    key: object  # block-manager sequence id
    kv_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [cached]


class ModelProposer(Proposer):
    def __init__(self, model, model_config, config: DrafterConfig, vocab_size: int, vocab_hash: str) -> None:
        self.model = model
        self.mcfg = model_config
        self.device = torch.device(config.device)
        self.vocab_size = vocab_size  # the target's (draft logits are cut / q padded to it)
        dtype = next(model.parameters()).dtype
        self.blocks = BlockManager(config.kv_num_blocks, config.kv_block_size)
        self.kv = PagedKVCache(
            model_config.num_layers,
            config.kv_num_blocks,
            config.kv_block_size,
            model.kv_entry_shape(),
            dtype,
            self.device,
        )
        self.chain_graphs = None  # chains as CUDA graphs (model_graph.py), on CUDA
        why = self._graphs_unsupported(model_config, config)
        if not why:
            self.chain_graphs = self._capture_graphs(config)
        elif self.device.type == "cuda" and config.graph_window > 0:
            warnings.warn(f"model drafter chains run eager: {why}", RuntimeWarning, stacklevel=2)
        super().__init__(
            DrafterInfo(
                family="model",
                vocab_size=vocab_size,
                vocab_hash=vocab_hash,
                max_block_size=config.max_block_size,
                needs_hidden_states=False,
                hidden_layers=(),
                has_probs=True,
                supports_tree=True,
            )
        )

    def _graphs_unsupported(self, model_config, config: DrafterConfig) -> str:
        """Why chains cannot run as CUDA graphs here ('' when they can)."""
        if self.device.type != "cuda":
            return f"device {self.device} is not CUDA"
        if config.graph_window <= 0:
            return "graph_window is 0"
        if model_config.moe_layers:
            return "a MoE draft LM (the torch MoE reference reads expert choices on the host)"
        return paged_torch_unsupported(model_config)

    def build_chain_graphs(self, window: int, k_max: int, attention: str = "paged_torch"):
        """The chain graphs' buffers over this drafter's model and cache, not captured yet (model_graph.py; on a
        CPU their bodies run eagerly: tests check them there)."""
        from specserve.draft_service.model_graph import ModelChainGraphs

        width = min(self.mcfg.vocab_size, self.vocab_size)  # the logits _forward returns
        window = min(window, self.kv.num_blocks * self.blocks.block_size)
        if self.model.fused_layers:  # the fused RoPE kernel reads cos / sin tables of max_position_embeddings rows
            window = min(window, self.mcfg.max_position_embeddings)
        bs = self.blocks.block_size
        window = max(window // bs * bs, -(-(k_max + 1) // bs) * bs)  # whole blocks; a feed holds up to k_max + 1 tokens
        return ModelChainGraphs(self.model, self.kv, self.blocks.block_size, window, width, k_max, k_max + 1, attention)

    def _capture_graphs(self, config: DrafterConfig):
        from specserve.models.attn_backend import triton_paged_unsupported

        attention = "paged_torch"
        if not triton_paged_unsupported(self.mcfg, self.device):
            # the Triton paged attention (one launch per layer) and the fused layers the target's graphs run:
            # residual add + RMSNorm, one q/k/v GEMM, QK-norm + RoPE + cache write (the eager path gets the norms)
            attention = "triton_paged"
            self.model.set_fused_layers(True)
        graphs = self.build_chain_graphs(config.graph_window, config.max_block_size, attention)
        return capture_all_or_warn(graphs, "model drafter chains")

    # ------------------------------------------------------------------ session state
    def _start_state(self, state: SessionState) -> None:
        fs = _ModelSession(key=object())
        self.blocks.add(fs.key, 0)
        state.family_state = fs

    def _release_state(self, state: SessionState) -> None:
        self.blocks.free(state.family_state.key)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch) -> torch.Tensor:
        """[T] ids -> [T, V] float32 logits, cut to the target's vocabulary."""
        try:
            out = self.model(ids.to(self.device), positions.to(self.device), attn, self.kv)
        except ValueError as e:  # ModelInputError: e.g. a token id the draft's embedding lacks
            raise ProposerError(f"model drafter refused its input: {e}") from e
        return self.model.compute_logits(out.hidden)[:, : self.vocab_size]

    def _feed(self, fs: _ModelSession, new: np.ndarray) -> torch.Tensor:
        """Append tokens to the cache (causal); returns the logits at the last one [V]."""
        start, n = len(fs.kv_tokens), len(new)
        try:
            table = self.blocks.grow(fs.key, start + n)
        except OutOfBlocks as e:
            self.blocks.truncate(fs.key, start)
            raise ProposerError(f"model drafter KV cache is full: {e}") from e
        attn = AttentionBatch.contiguous([n], [start], [table], self.blocks.block_size)
        logits = self._forward(torch.as_tensor(new), torch.arange(start, start + n), attn)
        fs.kv_tokens = np.concatenate([fs.kv_tokens, new])
        return logits[-1]

    def _catch_up(self, state: SessionState) -> torch.Tensor:
        """Sync the cache to S; returns the logits after S's last token (the pending token) [V]."""
        fs: _ModelSession = state.family_state
        ids, L = state.ids, len(state)
        keep = min(common_prefix_len(fs.kv_tokens, ids), L - 1)
        self.blocks.truncate(fs.key, keep)
        fs.kv_tokens = fs.kv_tokens[:keep]
        return self._feed(fs, ids[keep:L].copy())

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        fs: _ModelSession = state.family_state
        graphs = self.chain_graphs
        if graphs is not None and graphs.fits(len(state), num_tokens):
            return self._draft_chain_graphs(state, num_tokens)
        logits = self._catch_up(state)
        drafted, qs = [], []
        for i in range(num_tokens):
            tok, q = draw_tokens(logits[None], state.sampling, state.generator)
            drafted.append(int(tok[0]))
            if q is not None:
                qs.append(q)
            if i < num_tokens - 1:
                logits = self._feed(fs, np.array([drafted[-1]], dtype=np.int64))
        probs = None if not qs else to_target_probs(torch.cat(qs), self.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs)

    def _draft_chain_graphs(self, state: SessionState, num_tokens: int) -> DraftBlock:
        """The same chain through model_graph.py: feed (graph, or eager for a long feed), then the k draws in one
        replay; the cache then holds S + the first k - 1 drafted tokens, as after the eager chain."""
        fs: _ModelSession = state.family_state
        graphs = self.chain_graphs
        ids, L = state.ids, len(state)
        keep = min(common_prefix_len(fs.kv_tokens, ids), L - 1)
        feed, logits0 = None, None
        if graphs.feeds(L - keep):
            self.blocks.truncate(fs.key, keep)
            fs.kv_tokens = fs.kv_tokens[:keep]
            feed = (ids[keep:L].copy(), keep)
        else:
            logits0 = self._catch_up(state)
        try:
            table = self.blocks.grow(fs.key, L + num_tokens - 1)
        except OutOfBlocks as e:
            self.blocks.truncate(fs.key, keep)
            fs.kv_tokens = fs.kv_tokens[:keep]
            raise ProposerError(f"model drafter KV cache is full: {e}") from e
        drafted, q = graphs.draft(table, L, num_tokens, state.sampling, state.generator, feed, logits0)
        fs.kv_tokens = np.concatenate([ids[:L], np.asarray(drafted[:-1], dtype=np.int64)])
        probs = None if q is None else to_target_probs(q, self.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs)

    @torch.inference_mode()
    def _draft_tree(self, state: SessionState, spec: TreeSpec) -> DraftBlock:
        fs: _ModelSession = state.family_state
        root_logits = self._catch_up(state)
        ctx = len(fs.kv_tokens)
        table = self.blocks.block_table(fs.key)

        def expand(tokens, parents, nodes):
            feed: set[int] = set()
            for n in nodes:  # the nodes and all their ancestors, fed in creation order
                while n != -1 and n not in feed:
                    feed.add(n)
                    n = parents[n]
            order = sorted(feed)
            row = {n: r for r, n in enumerate(order)}
            depth = {}
            mask = torch.zeros(len(order), len(order), dtype=torch.bool)
            for n in order:
                depth[n] = 1 if parents[n] == -1 else depth[parents[n]] + 1
                a = n
                while a != -1:
                    mask[row[n], row[a]] = True
                    a = parents[a]
            attn = AttentionBatch(
                query_lens=(len(order),),
                context_lens=(ctx,),
                block_tables=(table,),
                slot_mapping=torch.full((len(order),), -1, dtype=torch.int64),
                tree_masks=(mask,),
            )
            ids = torch.tensor([tokens[n] for n in order], dtype=torch.int64)
            pos = torch.tensor([ctx - 1 + depth[n] for n in order], dtype=torch.int64)
            logits = self._forward(ids, pos, attn)
            return logits[[row[n] for n in nodes]]

        tree = build_tree(root_logits, expand, spec, state.sampling, state.generator)
        probs = None if tree.probs is None else to_target_probs(tree.probs, self.vocab_size)
        return DraftBlock(token_ids=tree.tokens, parents=tree.parents, probs=probs)


def build_model_proposer(config: DrafterConfig) -> ModelProposer:
    """Registry factory: load the draft LM; refuse it when its vocabulary differs from the target's."""
    from specserve.models.loader import load_model

    if config.checkpoint is None:
        raise DrafterConfigError("model drafter needs checkpoint = the draft model folder")
    if config.target_checkpoint is not None:
        vocab_size, vocab_hash = check_same_vocab(config.checkpoint, config.target_checkpoint)
    else:
        vocab_size, vocab_hash = checkpoint_vocab(config.checkpoint)
    name = target_name(config.target_checkpoint) if config.target_checkpoint is not None else None
    if (
        name is not None and name.scaled
    ):  # the demo's draft LM at a draft's size for the target (models/scaled_drafters.py)
        from specserve.models.scaled_drafters import scaled_draft_lm

        model, mcfg = scaled_drafter(lambda: scaled_draft_lm(config.checkpoint, name, config.device, config.dtype))
        return ModelProposer(model, mcfg, config, vocab_size, vocab_hash)
    try:
        model, mcfg = load_model(config.checkpoint, config.device, config.dtype, progress=False)
    except (ValueError, RuntimeError) as e:
        raise DrafterConfigError(f"cannot load the draft model {config.checkpoint}: {e}") from e
    return ModelProposer(model, mcfg, config, vocab_size, vocab_hash)
