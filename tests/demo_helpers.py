"""The shipped demo's pinned prompts and exact laws, shared by the tests of the demo at real size (target and
drafters): the held-out prompts cut to a length, the exact law of the first two tokens after a prompt from
transformers' demo in float64, and the chi-square of observed counts against a law."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

from specserve.contract.types import SamplingParams
from specserve.paths import demo_checkpoint


def demo_prompts(n: int = 2, length: int = 40) -> list[list[int]]:
    """The first n held-out prompts of the shipped demo, as token ids cut to `length`."""
    from specserve.models.loader import load_tokenizer
    from specserve.train.acceptance import load_prompts

    target = demo_checkpoint("target")
    return [p[:length] for p in load_prompts(target, load_tokenizer(target), n)]


def exact_demo_laws(prompt: list[int], sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:  # [V_demo] x 2
    """(law of the token after the prompt, law of the one after that) from transformers' demo in float64."""
    from transformers import AutoModelForCausalLM

    from specserve.models.probs import target_probs

    hf = AutoModelForCausalLM.from_pretrained(
        demo_checkpoint("target"), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        p1 = target_probs(hf(torch.tensor([prompt])).logits[0, -1:], sampling)[0].double()
        support = torch.nonzero(p1).flatten()
        p2 = target_probs(hf(torch.tensor([prompt + [int(e)] for e in support])).logits[:, -1], sampling).double()
    return p1, (p1[support, None] * p2).sum(0)


def chisquare_pvalue(counts: np.ndarray, expected: torch.Tensor) -> float:
    """Pearson's chi-square of counts [V] against the law `expected` [V]: cells with >= 5 expected draws, the rest
    pooled into one."""
    exp = expected.cpu().double().numpy() * counts.sum()
    big = exp >= 5
    obs, want = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
    keep = want > 0
    return chisquare(obs[keep], want[keep] * obs[keep].sum() / want[keep].sum()).pvalue
