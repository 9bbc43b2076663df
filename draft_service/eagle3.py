"""EAGLE-3 proposer: drafts chains or EAGLE-2 dynamic trees with an ``Eagle3Head`` (eagle3_head.py).

Alignment: S = t_0 .. t_{L-1} (t_{L-1} the pending token) and the target gave hidden rows h_0 ..
h_{L-2}. The head's entry for position j (1 <= j <= L-1) reads token t_j and feature fc(h_{j-1}) at
draft position j - 1 (the published heads drop t_0). Its output at the pending token gives the logits
of drafted token 1; drafted token i + 1 reads (embed(d_i), the head's own output at d_i).

Per session the head's K/V cache holds only CONFIRMED entries (tokens of S with target features);
drafted entries live in per-call scratch, so rollback is: keep the longest prefix whose tokens still
match S (never the pending token, which is always recomputed), feed the rest.

Target layers: ``hidden_layers`` in our capture convention (output of decoder layer i). Published heads
read the INPUT of layers (2, L/2, L-3) (``eagle_aux_hidden_state_layer_ids`` in their config, same
convention), which is the output of layers (1, L/2 - 1, L - 4): that is our default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.contract.types import DraftBlock, TreeSpec
from specserve.draft_service.drafter_config import DrafterConfig, DrafterInfo
from specserve.draft_service.drafter_errors import DrafterConfigError, RowsNotFinite
from specserve.draft_service.drafting import draw_tokens, to_target_probs
from specserve.draft_service.eagle3_head import Eagle3Head, load_eagle3_head
from specserve.draft_service.graph_capture import capture_all_or_warn, use_norm_kernel
from specserve.draft_service.proposer import Proposer
from specserve.draft_service.session_state import ROLLBACK_ROWS, SessionState, common_prefix_len
from specserve.draft_service.tree import build_tree


def default_eagle3_layers(num_target_layers: int) -> tuple[int, ...]:
    """Outputs of layers (1, L/2 - 1, L - 4) = inputs of (2, L/2, L - 3); tiny targets where those
    collide get (0, L/2, L - 1) (the engine refuses a repeated layer)."""
    n = num_target_layers
    if n < 3:
        raise DrafterConfigError(f"EAGLE-3 needs a target with >= 3 layers, got {n}")
    layers = (1, n // 2 - 1, n - 4)
    if len(set(layers)) < 3 or min(layers) < 0:
        layers = (0, n // 2, n - 1)
    return layers


@dataclass
class _Eagle3Session:
    k: torch.Tensor  # [cap, Hkv, D] confirmed entries (entry e = sequence position e + 1)
    v: torch.Tensor  # [cap, Hkv, D]
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [kv_len]

    @property
    def kv_len(self) -> int:
        return len(self.tokens)


class Eagle3Proposer(Proposer):
    def __init__(
        self,
        head: Eagle3Head,
        hidden_layers: tuple[int, ...],
        config: DrafterConfig,
        vocab_hash: str,
    ) -> None:
        if len(hidden_layers) != 3:
            raise DrafterConfigError(f"EAGLE-3 fuses exactly 3 target layers, got {hidden_layers}")
        head.fuse_projections()  # q/k/v and gate/up as one GEMM each (eagle3_head.py)
        self.head = head
        self.device = torch.device(config.device)
        self.dtype = config.dtype
        self.d2t_ids = head.draft_to_target()  # [Vd]
        self.d2t_host = self.d2t_ids.cpu()  # [Vd] the same on the host (a sampled block's q is mapped there)
        self.vocab_size = head.cfg.vocab_size
        self.chain_graphs = None  # catch-up and chains as CUDA graphs (eagle3_graph.py), on CUDA
        if self.device.type == "cuda" and config.graph_window > 0:
            self.chain_graphs = self._capture_graphs(config)
        super().__init__(
            DrafterInfo(
                family="eagle3",
                vocab_size=self.vocab_size,
                vocab_hash=vocab_hash,
                max_block_size=config.max_block_size,
                needs_hidden_states=True,
                hidden_layers=tuple(hidden_layers),
                has_probs=True,
                supports_tree=True,
            )
        )

    def build_chain_graphs(self, window: int, k_max: int):
        """The chain graphs' buffers over this drafter's head, not captured yet (eagle3_graph.py; on a CPU their
        bodies run eagerly: tests check them there)."""
        from specserve.draft_service.eagle3_graph import Eagle3ChainGraphs

        return Eagle3ChainGraphs(self.head, self.d2t_ids.to(self.device), window, k_max)

    def _capture_graphs(self, config: DrafterConfig):
        use_norm_kernel(self.head)
        graphs = self.build_chain_graphs(config.graph_window, config.max_block_size)
        return capture_all_or_warn(graphs, "eagle3 chains")

    def _hidden_width(self) -> int:
        return 3 * self.head.cfg.target_hidden_size

    # ------------------------------------------------------------------ session state
    def _start_state(self, state: SessionState) -> None:
        a = self.head.cfg.attention
        cap = max(64, 2 * len(state))
        shape = (cap, a.num_kv_heads, a.head_dim)
        state.family_state = _Eagle3Session(
            k=torch.zeros(shape, dtype=self.dtype, device=self.device),
            v=torch.zeros(shape, dtype=self.dtype, device=self.device),
        )

    def _ensure_capacity(self, fs: _Eagle3Session, n: int) -> None:
        if n <= fs.k.shape[0]:
            return
        cap = max(n, 2 * fs.k.shape[0])
        for name in ("k", "v"):
            old = getattr(fs, name)
            new = torch.zeros((cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(fs, name, new)

    @torch.inference_mode()
    def _catch_up(self, state: SessionState, defer: bool = False) -> tuple[torch.Tensor, int]:
        """Sync the confirmed cache to S: (the head's output at the pending token [H], deferred). With `defer` a
        catch-up that fits the graphs is only staged (deferred = its token count, 0 otherwise): the chain's replay runs
        it (eagle3_graph.py "block" graphs), and _keep_window_entries then copies its entries into the session's
        cache; the output is the window's out0, valid after that replay. A longer catch-up that fits the window runs
        its first tokens as replays of the long catch-up graphs, then its last k_max + 1 or fewer as above."""
        fs: _Eagle3Session = state.family_state
        ids, L = state.ids, len(state)
        keep = min(common_prefix_len(fs.tokens, ids[1:]), L - 2)
        n_new = L - 1 - keep  # entries for sequence positions keep+1 .. L-1
        feats = state.hidden_rows(keep, L - 1).to(self.device)  # [n_new, 3 * Ht]
        graphs = self.chain_graphs
        self._ensure_capacity(fs, L - 1)
        fs.tokens = ids[1:L].copy()
        state.drop_hidden_before(L - 1 - ROLLBACK_ROWS)
        while graphs is not None and n_new > graphs.k_max + 1 and (m := graphs.long_piece(keep, n_new)):
            _, k, v = graphs.catch_up(
                fs, fs.k, fs.v, keep, ids[keep + 1 : keep + 1 + m], feats[:m]
            )  # a long one's part
            fs.k[keep : keep + m], fs.v[keep : keep + m] = k, v
            keep, n_new, feats = keep + m, n_new - m, feats[m:]
        if graphs is not None and graphs.catch_up_fits(keep, n_new):  # one replay (eagle3_graph.py)
            out, k, v = graphs.catch_up(fs, fs.k, fs.v, keep, ids[keep + 1 : L], feats, run=not defer)
            if defer:
                return out, n_new
        else:
            if graphs is not None:
                graphs.owner = None  # the window does not hold what this eager catch-up computes
            tok = torch.as_tensor(ids[keep + 1 : L], device=self.device)
            pos = torch.arange(keep, L - 1, device=self.device)
            mask = torch.ones(n_new, keep + n_new, dtype=torch.bool, device=self.device)
            mask[:, keep:] = torch.ones(n_new, n_new, dtype=torch.bool, device=self.device).tril()
            outs, k, v = self.head.step(
                self.head.embed(tok), self.head.fuse(feats), pos, fs.k[:keep], fs.v[:keep], mask
            )
            out = outs[-1]
        fs.k[keep : L - 1], fs.v[keep : L - 1] = k, v
        return out, 0

    def _keep_window_entries(self, fs: _Eagle3Session, n: int) -> None:
        """After a replay that ran a deferred catch-up of n tokens: its entries from the window into the session's
        cache (device to device, queued after the replay)."""
        graphs, end = self.chain_graphs, fs.kv_len
        fs.k[end - n : end] = graphs.keys[end - n : end]
        fs.v[end - n : end] = graphs.values[end - n : end]

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def _draft_chain(self, state: SessionState, num_tokens: int) -> DraftBlock:
        if len(state) < 2:
            return DraftBlock(token_ids=())
        fs: _Eagle3Session = state.family_state
        graphs = self.chain_graphs
        on_graphs = graphs is not None and graphs.fits(len(state) - 1, num_tokens)
        out, deferred = self._catch_up(state, defer=on_graphs)
        ctx, base = fs.kv_len, len(state) - 2  # draft position of the pending token
        spec_k, spec_v = fs.k[:ctx], fs.v[:ctx]
        if on_graphs:  # one replay: the deferred catch-up and the chain (or the chain alone)
            if graphs.owner is not fs:  # the catch-up ran eagerly: the window takes its result
                graphs.load(fs, spec_k, spec_v, out)
            drafted, q, rows_ok = graphs.draft(
                num_tokens, state.sampling, state.generator, catch_up=deferred, rows_check=state.take_rows_check()
            )
            if not rows_ok:
                raise RowsNotFinite("")
            if deferred:
                self._keep_window_entries(fs, deferred)
            probs = None if q is None else to_target_probs(q, self.vocab_size, self.d2t_host)
            return DraftBlock(token_ids=tuple(drafted), probs=probs)
        logits = self.head.logits(out[None])  # [1, Vd]
        positions = torch.arange(base + 1, base + num_tokens, device=self.device)  # [k - 1], made once
        drafted, qs = [], []  # device tensors: the chain is read back once, at the end
        for i in range(num_tokens):
            tok, q = draw_tokens(logits, state.sampling, state.generator)
            target_id = self.d2t_ids[tok]  # [1]
            drafted.append(target_id)
            if q is not None:
                qs.append(q)
            if i == num_tokens - 1:
                break
            mask = torch.ones(1, spec_k.shape[0] + 1, dtype=torch.bool, device=self.device)
            out, k, v = self.head.step(
                self.head.embed(target_id), out[None], positions[i : i + 1], spec_k, spec_v, mask
            )
            out = out[0]
            spec_k, spec_v = torch.cat([spec_k, k]), torch.cat([spec_v, v])
            logits = self.head.logits(out[None])
        probs = None if not qs else to_target_probs(torch.cat(qs), self.vocab_size, self.d2t_host)
        return DraftBlock(token_ids=tuple(torch.cat(drafted).tolist()), probs=probs)

    @torch.inference_mode()
    def _draft_tree(self, state: SessionState, spec: TreeSpec) -> DraftBlock:
        if len(state) < 2:
            return DraftBlock(token_ids=(), parents=())
        fs: _Eagle3Session = state.family_state
        root_out, _ = self._catch_up(state)
        ctx, base = fs.kv_len, len(state) - 2
        graphs = self.chain_graphs
        if graphs is not None and graphs.trees.fits(ctx, spec):  # the whole tree in one replay (eagle3_tree_graph.py)
            if graphs.owner is not fs:  # the catch-up ran eagerly: the window takes its result
                graphs.load(fs, fs.k[:ctx], fs.v[:ctx], root_out)
            tokens, parents, q = graphs.trees.draft(spec, state.sampling, state.generator)
            probs = None if q is None else to_target_probs(q, self.vocab_size, self.d2t_host)
            return DraftBlock(token_ids=tuple(tokens), parents=tuple(parents), probs=probs)
        fed: list[int] = []  # nodes whose entries exist, in feeding order
        node_out: dict[int, torch.Tensor] = {-1: root_out}
        node_k: list[torch.Tensor] = []  # [1, Hkv, D] per fed node
        node_v: list[torch.Tensor] = []

        def expand(tokens, parents, nodes):
            depth = {}
            for n in range(len(tokens)):
                depth[n] = 1 if parents[n] == -1 else depth[parents[n]] + 1
            t = len(nodes)
            tok = self.d2t_ids[torch.as_tensor(tokens, device=self.device)[list(nodes)]]
            feats = torch.stack([node_out[parents[n]] for n in nodes])  # [t, H]
            pos = torch.tensor([base + depth[n] for n in nodes], device=self.device)
            past_k = torch.cat([fs.k[:ctx], *node_k]) if node_k else fs.k[:ctx]
            past_v = torch.cat([fs.v[:ctx], *node_v]) if node_v else fs.v[:ctx]
            mask = torch.zeros(t, ctx + len(fed) + t, dtype=torch.bool, device=self.device)
            mask[:, :ctx] = True
            for r, n in enumerate(nodes):
                anc = parents[n]
                while anc != -1:
                    mask[r, ctx + fed.index(anc)] = True
                    anc = parents[anc]
                mask[r, ctx + len(fed) + r] = True
            out, k, v = self.head.step(self.head.embed(tok), feats, pos, past_k, past_v, mask)
            for r, n in enumerate(nodes):
                fed.append(n)
                node_out[n] = out[r]
                node_k.append(k[r : r + 1])
                node_v.append(v[r : r + 1])
            return self.head.logits(out)

        tree = build_tree(self.head.logits(root_out[None])[0], expand, spec, state.sampling, state.generator)
        target_ids = self.d2t_host[list(tree.tokens)].tolist() if tree.tokens else []
        probs = None
        if tree.probs is not None:
            probs = to_target_probs(tree.probs, self.vocab_size, self.d2t_host)
        return DraftBlock(token_ids=tuple(target_ids), parents=tree.parents, probs=probs)


def build_eagle3_proposer(config: DrafterConfig) -> Eagle3Proposer:
    """Registry factory: load the head, pick the target layers, check the vocabulary."""
    from specserve.draft_service.checkpoint_checks import scaled_drafter, target_config, target_name, target_vocab

    if config.checkpoint is None:
        raise DrafterConfigError("eagle3 needs checkpoint = the EAGLE-3 head folder")
    name = target_name(config.target_checkpoint) if config.target_checkpoint is not None else None
    if name is not None and name.scaled:  # the demo's head at the target's size (models/scaled_drafters.py)
        from specserve.models.scaled_drafters import scaled_eagle3_head

        demo = load_eagle3_head(config.checkpoint, name.folder, "cpu", torch.float32)
        head = scaled_drafter(lambda: scaled_eagle3_head(demo, config.checkpoint, name, config.device, config.dtype))
    else:
        head = load_eagle3_head(config.checkpoint, config.target_checkpoint, config.device, config.dtype)
    vocab_hash = f"size:{head.cfg.vocab_size}"
    layers = config.hidden_layers
    if layers is None and head.cfg.aux_layers is not None:
        if min(head.cfg.aux_layers) < 1:
            raise DrafterConfigError("eagle_aux_hidden_state_layer_ids must be >= 1 (layer inputs)")
        layers = tuple(i - 1 for i in head.cfg.aux_layers)
    if config.target_checkpoint is not None:
        vocab = target_vocab(config.target_checkpoint)
        t_size, t_hash = vocab.size, vocab.hash
        if t_size != head.cfg.vocab_size:
            from specserve.draft_service.drafter_errors import VocabMismatchError

            raise VocabMismatchError(f"EAGLE-3 head vocab_size {head.cfg.vocab_size} != target vocab_size {t_size}")
        vocab_hash = t_hash
        target = target_config(config.target_checkpoint)
        if target.hidden_size != head.cfg.target_hidden_size:
            raise DrafterConfigError(
                f"EAGLE-3 head expects target hidden size {head.cfg.target_hidden_size}, target has"
                f" {target.hidden_size}"
            )
        if layers is None:
            layers = default_eagle3_layers(target.num_layers)
    if layers is None:
        raise DrafterConfigError("eagle3: give hidden_layers or the target checkpoint to derive them")
    return Eagle3Proposer(head, layers, config, vocab_hash)
