"""The adaptive block-size chooser: cost-model fit, acceptance estimates and the argmax."""

import numpy as np

from specserve.gateway.adaptive import AdaptiveConfig, AdaptiveSpeculation, VerifyCostModel, expected_emitted


def test_cost_model_recovers_linear_costs_and_reports_heldout_error() -> None:
    rng = np.random.default_rng(0)
    model = VerifyCostModel(window=512, refit_every=8)
    steps = []
    for _ in range(300):
        n = int(rng.integers(1, 17))
        e = int(8 * n ** 0.7 + rng.integers(0, 4))
        ms = 1.0 + 0.05 * n + 0.02 * e + float(rng.normal(0, 0.01))
        steps.append((n, e, ms))
    for n, e, ms in steps[:250]:
        model.observe(n, e, ms)
    model.fit()
    assert np.allclose(model.coef, [1.0, 0.05, 0.02], atol=0.02)
    assert model.heldout_error(steps[250:]) < 0.02


def test_expected_emitted_matches_hand_computation() -> None:
    alpha = np.array([0.5, 0.5])
    assert np.allclose(expected_emitted(alpha), [1.0, 1.5, 1.75])


def test_choose_k_grows_with_acceptance_and_shrinks_with_cost() -> None:
    spec = AdaptiveSpeculation(AdaptiveConfig(max_k=8))
    for n in range(1, 10):  # verify costs 1 ms + 0.1 ms per token
        spec.cost.observe(n, 0, 1.0 + 0.1 * n)
    spec.cost.fit()
    high = spec.choose_k(8, confidence=np.full(8, 0.95))
    low = spec.choose_k(8, confidence=np.full(8, 0.05))
    assert high == 8 and low == 0
    for n in range(1, 10):  # now every token costs a lot (many new experts)
        spec.cost.observe(n, 0, 1.0 + 2.0 * n)
    spec.cost.fit()
    assert spec.choose_k(8, confidence=np.full(8, 0.8)) < high


def test_acceptance_estimator_learns_per_position_rates() -> None:
    spec = AdaptiveSpeculation(AdaptiveConfig(max_k=4, ema=0.2))
    for _ in range(200):
        spec.observe_verify(num_drafted=4, num_accepted=1, experts=0, ms=1.0)
    assert spec.accept.alpha[0] > 0.95 and spec.accept.alpha[1] < 0.05
