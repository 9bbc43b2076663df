"""The verify fit's cheaper parts give what the plain formulas give (specserve/loop/cost_models.py, issue #42): each
group's median from one sort (group_medians) equals np.median of the group, nonneg_lstsq with its subsets made once
(Subsets) equals it making them each call, and the fit's coefficients equal the fit written plainly (outliers: a
step more than twice its (tokens, ahead) group's median, in groups of 3 or more, left out)."""

from __future__ import annotations

import random

import numpy as np

from specserve.loop.cost_models import Subsets, VerifyCostModel, group_medians, nonneg_lstsq


def _plain_fit(model: VerifyCostModel) -> np.ndarray:
    m = model.observed
    x, y = np.array(model._x[:m], dtype=float), np.array(model._y[:m])
    keep = np.ones(m, dtype=bool)
    groups = x[:, 1] * 2 + x[:, 3]
    for g in np.unique(groups):
        members = groups == g
        if members.sum() >= 3:
            keep &= ~members | (y <= 2.0 * np.median(y[members]))
    x, y = x[keep], y[keep]
    if len(np.unique(x[:, 1])) < 3:
        x[:, 2] = 0.0
    return nonneg_lstsq(x, y, VerifyCostModel._ORDER)


def test_group_medians_are_each_groups_np_median_and_size() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 256):
        keys = rng.integers(0, 5, n).astype(float)
        values = rng.random(n).round(2)  # ties too
        medians, sizes = group_medians(keys, values)
        for i in range(n):
            members = values[keys == keys[i]]
            assert medians[i] == np.median(members) and sizes[i] == len(members)


def test_nonneg_lstsq_with_its_subsets_made_once_is_the_same() -> None:
    rng = np.random.default_rng(1)
    order = VerifyCostModel._ORDER
    subsets = Subsets(4, order)
    for _ in range(20):
        x = np.c_[np.ones(30), rng.integers(1, 6, 30), rng.integers(10, 60, 30), rng.integers(0, 2, 30)].astype(float)
        y = x @ rng.normal(0.5, 1.0, 4) + rng.normal(0, 0.1, 30)
        assert np.array_equal(nonneg_lstsq(x, y, order, subsets), nonneg_lstsq(x, y, order))


def test_the_verify_fit_equals_the_plain_formula() -> None:
    for seed in range(10):
        r = random.Random(seed)
        model = VerifyCostModel(window=64)
        for step in range(100):
            n = 1 + r.randrange(5 if seed % 2 else 2)  # odd seeds: 5 token counts (the experts column in)
            ms = 3 + 0.2 * n + (4 if r.random() < 0.1 else 0.1 * r.random())  # a one-off now and then
            model.observe(n, 40 + 10 * n + r.randrange(3), ms, ahead=r.random() < 0.3)
            if step % 9 == 0:
                model.fit()
                assert np.array_equal(model.coef, _plain_fit(model)), (seed, step)
