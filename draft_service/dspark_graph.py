"""DSpark blocks as CUDA graphs: DFlash's graphs (dflash_graph.py: the context window, the extend graphs, one pinned
copy a propose) with the block graph's body replaced by DSpark's drafting (dspark.py): the block's one pass, then the
Markov chain over its rows, greedy or sampled (graph_sampling.py), tokens and confidences in static buffers read back
with one device read. Not captured (a CPU), the same bodies run eagerly over the same buffers: CPU tests check them.
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.dflash_graph import DFlashBlockGraphs


class DSparkBlockGraphs(DFlashBlockGraphs):
    def __init__(self, spark, window: int, k_max: int) -> None:  # spark: a DSparkModel
        super().__init__(spark.block, window, k_max, passes=1)
        self.spark = spark
        self.out = torch.zeros(2 * k_max, device=self.tokens.device)  # [2 k_max] float32: ids (exact), then c

    def _block_body(self, k: int, sampled: bool) -> None:
        b = self.model.cfg.block_size
        ctx_mask = (self._rows < self.ctx)[None].expand(b, self.window)  # [b, W]
        kv = list(zip(self.keys, self.values))
        z = self.model.block_hidden(self.first, self.first_pos, kv, ctx_mask=ctx_mask)[:k]  # [k, H]

        def draw(logits: torch.Tensor, i: int) -> torch.Tensor:  # [1, V] -> [1]
            return self.sampler.draw(logits, i, i + 1) if sampled else logits.argmax(dim=-1)

        tokens, conf = self.spark.chain(z, self.first, draw)
        self.out[:k].copy_(tokens)
        self.out[k : 2 * k].copy_(conf)

    @torch.inference_mode()
    def draft(
        self,
        k: int,
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[list[int], torch.Tensor | None, list[float]]:  # k ids, q [k, V] (sampled) or None, k confidences (raw)
        sampled = not sampling.greedy
        if sampled:
            self.sampler.set(sampling, generator, k)
        self._run(("block", k, sampled))
        both = self.out[: 2 * k].tolist()  # the block's one device read (q follows it)
        return [int(t) for t in both[:k]], (self.sampler.q[:k].clone() if sampled else None), both[k:]
