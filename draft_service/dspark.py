"""DSpark-style block drafter: DFlash's parallel block (dflash.py), a small Markov head, a per-position confidence head.

Model. The block is a DFlashModel (its context K/V from the target's hidden rows, one non-causal pass over
[embed(pending), mask, ...]) run once, in one pass (no denoising passes): z_i [H] is its final-normed row of drafted
position i. The drafted tokens are then chosen one after another, each conditioned on the one before by the Markov
head (prev_1 = the pending token, prev_i = drafted token i - 1):

    u_i      = silu(h_proj z_i + e_proj embed(prev_i))                  [r]   (embed: the block's, the target's)
    logits_i = lm_head z_i + out u_i                                      [V]   (a rank-r correction of the logits,
                                                                                 from position markov_from on)
    x_i      ~ q_i = the request's sampling transform of logits_i        (greedy: the argmax)
    c_i      = sigmoid(w_z . z_i + w_u . u_i + w_lp * log softmax(logits_i)[x_i] + bias)

``markov_from`` (config.json; 0 when absent, as in the first checkpoints; 1 for those trained since issue #43's CPU
study): the first position the correction applies to. Position 1's previous token is the pending token, which the
block already reads as its input 0, so its correction is redundant, and trained it overfits: on held-out blocks with
the shipped DFlash block frozen, rank 32 took position 1's agreement from 0.747 to 0.656 (BENCHMARKS.md, issue #43).
u_1 is still made (the confidence head reads it).

lm_head runs once over the block's rows (one GEMM, as DFlash's); the Markov head adds a [V, r] GEMV a position. c_i is
the head's estimate that x_i is accepted given x_1..x_{i-1} were: it goes out as DraftBlock.confidence and sets how
many tokens a step verifies (specserve/loop/verify_length.py). q_i is the distribution x_i was drawn from given the tokens
drawn before it (they are all the Markov head saw), so sampled verification stays lossless.

Checkpoint layout (``save_dspark`` / ``load_dspark``): config.json = the block's DFlash config.json (dflash.py's
layout) with ``model_type: "dspark"`` and ``markov_rank``; model.safetensors = the block's tensors under DFlash's
names, plus ``markov.{h_proj,e_proj,out}.weight`` ([r, H], [r, H], [V, r]) and ``confidence.{w_z.weight [1, H],
w_z.bias [1], w_u.weight [1, r], w_lp [1]}``; ``markov_from`` in config.json. The block shares the target's embeddings and lm_head (read from the
target at load) or has its own, as DFlash's does. No published DSpark layout is documented; this is ours.

Serving is DFlash's proposer (its session cache, context extension and graphs' window) with the block's drafting
replaced: eagerly here, as CUDA graphs in dspark_graph.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.contract.types import DraftBlock
from specserve.draft_service.dflash import (
    WEIGHTS_FILE,
    DFlashModel,
    DFlashProposer,
    block_identity,
    copy_checked,
    dflash_tensors,
    load_block,
    load_block_drafter,
    read_config_json,
)
from specserve.draft_service.dflash_config import DFlashConfig
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError
from specserve.draft_service.drafting import draw_tokens, to_target_probs
from specserve.draft_service.session_state import SessionState
from specserve.draft_service.target_tensors import read_tensors

Draw = Callable[[torch.Tensor, int], torch.Tensor]  # (logits [1, V] of position i, i) -> the drawn token [1] int64


@dataclass(frozen=True)
class DSparkConfig:
    block: DFlashConfig  # the parallel block (one pass: denoise_steps 1)
    markov_rank: int
    markov_from: int = 0  # the first drafted position (0-based) the Markov correction applies to (module docstring)

    def __post_init__(self) -> None:
        if not isinstance(self.markov_rank, int) or self.markov_rank <= 0:
            raise DrafterConfigError(f"dspark config: markov_rank must be a positive int, got {self.markov_rank!r}")
        if not isinstance(self.markov_from, int) or self.markov_from < 0:
            raise DrafterConfigError(f"dspark config: markov_from must be an int >= 0, got {self.markov_from!r}")
        if self.block.denoise_steps != 1:
            raise DrafterConfigError(
                f"dspark config: the block runs in one pass (denoise_steps 1), got {self.block.denoise_steps}"
            )

    def to_dict(self) -> dict:
        return dict(
            self.block.to_dict(), model_type="dspark", markov_rank=self.markov_rank, markov_from=self.markov_from
        )

    @staticmethod
    def from_dict(raw: dict) -> DSparkConfig:
        if raw.get("model_type") != "dspark":
            raise DrafterConfigError(f"dspark config.json must say model_type 'dspark', got {raw.get('model_type')!r}")
        if "markov_rank" not in raw:
            raise DrafterConfigError("dspark config.json lacks markov_rank")
        block = {k: v for k, v in raw.items() if k not in ("markov_rank", "markov_from")}
        block_cfg = DFlashConfig.from_dict(dict(block, model_type="dflash"))
        return DSparkConfig(block_cfg, raw["markov_rank"], raw.get("markov_from", 0))


class MarkovHead(nn.Module):
    """u = silu(h_proj z + e_proj e), delta = out u: the previous token's (e) rank-r correction of the logits."""

    def __init__(self, hidden: int, rank: int, vocab: int) -> None:
        super().__init__()
        self.h_proj = nn.Linear(hidden, rank, bias=False)
        self.e_proj = nn.Linear(hidden, rank, bias=False)
        self.out = nn.Linear(rank, vocab, bias=False)

    def u(self, z: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """z [..., H], e [..., H] -> u [..., r] (what the confidence head reads; no [V, r] GEMV)."""
        return F.silu(self.h_proj(z) + self.e_proj(e))

    def forward(self, z: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [..., H] block rows, e [..., H] embeddings of the previous tokens -> (u [..., r], delta [..., V] f32)."""
        u = self.u(z, e)
        return u, self.out(u).float()


class ConfidenceHead(nn.Module):
    """c = sigmoid(w_z . z + w_u . u + w_lp * lp + bias): the chance the drafted token is accepted."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.w_z = nn.Linear(hidden, 1)
        self.w_u = nn.Linear(rank, 1, bias=False)
        self.w_lp = nn.Parameter(torch.zeros(1))

    def logit(self, z: torch.Tensor, u: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """z [..., H], u [..., r], lp [...] (log q at temperature 1 of the drafted token) -> [...] float32 logits."""
        return (self.w_z(z).float() + self.w_u(u).float())[..., 0] + self.w_lp.float() * lp.float()

    def forward(self, z: torch.Tensor, u: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logit(z, u, lp))


class DSparkModel(nn.Module):
    """``block``: a DFlashModel of cfg.block already made (a loaded one), else a new one."""

    def __init__(self, cfg: DSparkConfig, block: DFlashModel | None = None) -> None:
        super().__init__()
        self.spark_cfg = cfg
        self.block = DFlashModel(cfg.block) if block is None else block
        h = cfg.block.hidden_size
        self.markov = MarkovHead(h, cfg.markov_rank, cfg.block.vocab_size)
        self.confidence = ConfidenceHead(h, cfg.markov_rank)

    def chain(
        self,
        z: torch.Tensor,  # [k, H] the block's rows of drafted positions 1..k
        first: torch.Tensor,  # [1] int64 the pending token
        draw: Draw,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [k] int64, confidence [k] float32 (device ops only)
        """The k drafted tokens, one after another through the Markov head (module docstring)."""
        base = self.block.head_logits(z)  # [k, V] one lm_head GEMM for the block
        prev, tokens, conf = first, [], []
        for i in range(z.shape[0]):
            e = self.block.embed_tokens(prev)  # [1, H]
            if i >= self.spark_cfg.markov_from:
                u, delta = self.markov(z[i : i + 1], e)  # [1, r], [1, V]
                logits = base[i : i + 1] + delta
            else:  # no correction here (module docstring): u alone, for the confidence head
                u, logits = self.markov.u(z[i : i + 1], e), base[i : i + 1]
            tok = draw(logits, i)  # [1]
            lp = torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None])[:, 0]  # [1]
            conf.append(self.confidence(z[i : i + 1], u, lp))
            tokens.append(tok)
            prev = tok
        return torch.cat(tokens), torch.cat(conf)


def save_dspark(model: DSparkModel, out_dir: str | Path) -> None:
    """Write config.json + model.safetensors (the layout in the module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dflash_tensors(model.block)
    for prefix, head in (("markov.", model.markov), ("confidence.", model.confidence)):
        tensors.update({prefix + k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()})
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(model.spark_cfg.to_dict(), indent=2))


def load_dspark(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    target_dir: str | Path | None = None,  # required when the block shares the target's head
) -> DSparkModel:
    path = Path(path)
    cfg = DSparkConfig.from_dict(read_config_json(path, "dspark"))
    model = DSparkModel(cfg, load_block(cfg.block, {}, path, "cpu", torch.float32, target_dir))
    heads = {f"{p}.{k}": v for p in ("markov", "confidence") for k, v in getattr(model, p).state_dict().items()}
    tensors = read_tensors(path / WEIGHTS_FILE, "dspark", heads)
    with torch.no_grad():
        for name, param in heads.items():
            if name not in tensors:
                raise DrafterConfigError(f"dspark checkpoint {path} lacks tensor {name}")
            copy_checked(param, tensors[name], f"dspark tensor {name}")
    return model.to(device=device, dtype=dtype).eval()


class DSparkProposer(DFlashProposer):
    """DFlash's proposer (context cache, extension, graph window) over the DSpark block; its drafting is the chain."""

    FAMILY = "dspark"

    def __init__(self, model: DSparkModel, config: DrafterConfig, hidden_layers: tuple[int, ...], vocab_hash: str):
        if config.denoise_steps not in (None, 1):
            raise DrafterConfigError(
                f"dspark drafts its block in one pass; --denoise-steps {config.denoise_steps} does not apply"
            )
        self.spark = model
        super().__init__(model.block, config, hidden_layers, vocab_hash)

    def build_block_graphs(self, window: int, k_max: int):
        from specserve.draft_service.dspark_graph import DSparkBlockGraphs

        return DSparkBlockGraphs(self.spark, window, min(k_max, self.model.cfg.drafts_per_block))

    def _graph_block(self, state: SessionState, num_tokens: int) -> DraftBlock:
        drafted, q, conf = self.block_graphs.draft(num_tokens, state.sampling, state.generator)
        probs = None if q is None else to_target_probs(q, self.vocab_size)
        return DraftBlock(token_ids=tuple(drafted), probs=probs, confidence=clamped(conf))

    def _eager_block(self, state: SessionState, num_tokens: int) -> DraftBlock:
        fs, L = state.family_state, len(state)
        first = torch.as_tensor(state.ids[L - 1 : L], device=self.device)
        z = self.model.block_hidden(first, L - 1, fs.kv)[:num_tokens]  # [k, H]
        qs: list[torch.Tensor] = []

        def draw(logits: torch.Tensor, i: int) -> torch.Tensor:
            tok, q = draw_tokens(logits, state.sampling, state.generator)
            if q is not None:
                qs.append(q)
            return tok

        tokens, conf = self.spark.chain(z, first, draw)
        probs = None if not qs else to_target_probs(torch.cat(qs), self.vocab_size)
        both = torch.cat([tokens.float(), conf.float()]).tolist()  # one read of ids (exact below 2^24) and c
        return DraftBlock(
            token_ids=tuple(int(t) for t in both[:num_tokens]), probs=probs, confidence=clamped(both[num_tokens:])
        )


def clamped(conf: list[float]) -> tuple[float, ...]:
    """Confidences as DraftBlock takes them: in [0, 1], a NaN (a broken head) 0 (verify none of it)."""
    return tuple(min(max(c, 0.0), 1.0) if c == c else 0.0 for c in conf)


def build_dspark_proposer(config: DrafterConfig) -> DSparkProposer:
    model = load_block_drafter(config, "dspark", load_dspark, "specserve.models.scaled_dspark:scaled_dspark")
    return DSparkProposer(model, config, *block_identity(model.block.cfg, config, "dspark"))
