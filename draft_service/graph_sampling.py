"""Sampled drafts inside a CUDA graph: q from sampling parameters held on the device, drawn with noise made before the
replay (used by model_graph.py and dflash_graph.py).

The eager drafters (drafting.draw_tokens) draw with torch.multinomial from q = target_probs(logits, params), the
parameters baked in as host numbers. A captured graph cannot take new host numbers per request, nor read the device
from the host. Here:

- temperature, top_p and top_k live in one small device buffer, refilled before each replay (one host-to-device copy
  from pinned memory), so one graph serves every sampled request;
- q is specserve.models.probs.target_probs' transform (temperature, then top-k, then top-p), its Python branches
  turned into device-side conditions (`models.probs.device_target_probs`; tests compare the two on the CPU);
- the drafted token is argmax(q / E) with E ~ Exp(1) drawn per vocabulary entry before the replay: P(argmax = x) =
  q(x), so the token is a draw from q, and q goes back for the target's verify. The noise comes from a generator on
  the graph's device, reseeded for every replay from the session's own generator (a seeded request stays
  reproducible, and a session's draws depend only on its generator, as the eager chain's do).
"""

from __future__ import annotations

import torch

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_capture import StagedBuffer
from specserve.models.probs import device_target_probs

_TINY = 1e-30  # Exp(1) noise is clamped above 0: q(x) = 0 then scores 0, never 0 / 0


class GraphSampler:
    """The static buffers of sampled draws: parameters, noise, and the q of each drawn row."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self._staged = StagedBuffer(3, torch.float32, device)
        self.params = self._staged.values  # [3] temperature, top_k, top_p
        self.params.copy_(torch.tensor([1.0, 0.0, 1.0]))
        self.noise = torch.ones(rows, vocab, device=device)  # [R, V] Exp(1) draws of the next replay
        self.q = torch.zeros(rows, vocab, device=device)  # [R, V] float32: q of every drawn row
        self.generator = torch.Generator(device=device)  # reseeded from the session's generator by set()

    def set(self, sampling: SamplingParams, session_generator: torch.Generator, rows: int) -> None:
        """Before a replay: this request's parameters, and fresh noise for its first `rows` draws (the session's
        generator advances by one draw)."""
        self._staged.host()[:] = (sampling.temperature, float(sampling.top_k), sampling.top_p)
        self._staged.send()
        seed = torch.randint(0, 2**62, (1,), generator=session_generator)  # a host tensor (the session's generator)
        self.generator.manual_seed(int(seed.numpy()[0]) if seed.device.type == "cpu" else int(seed))
        self.noise[:rows].exponential_(generator=self.generator).clamp_min_(_TINY)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, V] float32
        return device_target_probs(logits, self.params[0], self.params[1], self.params[2])

    def draw(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:  # [end - start, V] -> [end - start]
        """Draw rows start..end-1 of this replay: q into self.q, the tokens returned (device ops only)."""
        q = self.probs(logits)
        self.q[start:end].copy_(q)
        return (q / self.noise[start:end]).argmax(dim=-1)
