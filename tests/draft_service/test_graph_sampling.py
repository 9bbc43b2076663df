"""Sampled draws inside a CUDA graph (draft_service/graph_sampling.py): the device-side q equals the target sampler's
transform for every combination of temperature, top-k and top-p, and argmax(q / Exp(1) noise) is a draw from q."""

from __future__ import annotations

import pytest
import torch
from draft_helpers import draws_pvalue

from specserve.contract.types import SamplingParams
from specserve.draft_service.graph_sampling import GraphSampler
from specserve.models.probs import target_probs

VOCAB = 50


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [0, 1, 5, VOCAB, VOCAB + 3])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
def test_device_q_is_the_target_samplers_transform(temperature, top_k, top_p):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(top_k)) * 3
    logits[0, :4] = logits[0, 0]  # ties at the top (top-k / top-p cut through them alike)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = GraphSampler(3, VOCAB, torch.device("cpu"))
    sampler.set(sampling, torch.Generator().manual_seed(0), 3)
    torch.testing.assert_close(sampler.probs(logits), target_probs(logits, sampling), atol=1e-6, rtol=1e-5)


def test_draws_follow_q_and_reseed_from_the_session_generator():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    sampling = SamplingParams(temperature=1.0, top_k=12)
    sampler = GraphSampler(1, VOCAB, torch.device("cpu"))
    session = torch.Generator().manual_seed(7)
    draws = []
    for _ in range(3000):
        sampler.set(sampling, session, 1)
        draws.append(int(sampler.draw(logits, 0, 1)))
    q = sampler.q[0].clone()
    torch.testing.assert_close(q, target_probs(logits, sampling)[0])
    assert all(q[t] > 0 for t in draws)  # never a token outside top-k
    assert draws_pvalue(draws, q) > 1e-3
    assert draws_pvalue(draws, torch.softmax(logits[0], -1)) < 1e-3  # the check tells q from the untruncated p
    again = GraphSampler(1, VOCAB, torch.device("cpu"))
    session = torch.Generator().manual_seed(7)
    replay = []
    for _ in range(50):
        again.set(sampling, session, 1)
        replay.append(int(again.draw(logits, 0, 1)))
    assert replay == draws[:50]  # the same session seed draws the same tokens
