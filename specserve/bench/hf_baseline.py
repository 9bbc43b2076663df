"""The outside baseline: Hugging Face transformers `generate` on the same checkpoint and prompts.

Methods: greedy decoding; assisted generation with the draft LM (`assistant_model=`, constant k) when
a draft LM checkpoint exists; prompt lookup (`prompt_lookup_num_tokens=k`), transformers' n-gram
drafter. Times come from a streamer: the first put after the prompt marks the first token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.bench.runner import RequestResult


@dataclass(frozen=True)
class HFMethod:
    name: str  # "hf/greedy" | "hf/assisted" | "hf/prompt-lookup"
    assisted: bool = False
    prompt_lookup: bool = False


class _TimingStreamer:
    """Records when generate() hands over its first new token."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:  # put #1 is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFBaseline:
    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype, eos_token_ids: Sequence[int], k: int) -> None:
        from transformers import AutoModelForCausalLM

        from specserve.bench.quiet import silence_library_bars

        silence_library_bars()  # transformers' loading bar and chatter would break the bench's bar
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.assistant = None
        self.eos = list(eos_token_ids)
        self.k = k

    def load_assistant(self, assistant_dir: Path) -> None:
        """The draft LM for assisted generation, drafting a constant k tokens per step."""
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=self.dtype).to(self.device).eval()
        gc = assistant.generation_config
        gc.num_assistant_tokens = self.k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0  # always draft k tokens (no early exit)
        self.assistant = assistant

    def _generate_kwargs(self, max_new_tokens: int) -> dict:
        """Greedy, explicit stop ids (the engine's), no sampling knobs from the checkpoint."""
        return {
            "max_new_tokens": max_new_tokens,
            "do_sample": False,
            "num_beams": 1,
            "eos_token_id": self.eos or None,
            "pad_token_id": self.eos[0] if self.eos else 0,
        }

    def methods(self) -> list[HFMethod]:
        out = [HFMethod("hf/greedy")]
        if self.assistant is not None:
            out.append(HFMethod("hf/assisted", assisted=True))
        out.append(HFMethod("hf/prompt-lookup", prompt_lookup=True))
        return out

    @torch.inference_mode()
    def run(
        self, method: HFMethod, prompt_id: str, prompt_ids: Sequence[int], max_new_tokens: int, seed: int
    ) -> RequestResult:
        torch.manual_seed(seed)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        kwargs = {}
        if method.assisted:
            kwargs["assistant_model"] = self.assistant
        if method.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.k
        streamer = _TimingStreamer()
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            streamer=streamer,
            **self._generate_kwargs(max_new_tokens),
            **kwargs,
        )
        _sync(self.device)
        t_end = time.perf_counter()
        new = tuple(int(t) for t in out[0, ids.shape[1] :].tolist())
        t_first = streamer.first_token_at or t_end
        finish = "eos" if new and new[-1] in self.eos else "length"
        return RequestResult(
            method=method.name,
            prompt_id=prompt_id,
            prompt_tokens=len(prompt_ids),
            token_ids=new,
            finish_reason=finish,
            ttft_s=t_first - t0,
            decode_s=t_end - t_first,
            stats={},
        )
