"""Helpers of the sampled (lossless) tests: the two-sample test (are two samples of tokens drawn from one law?) and
the suite's pinned seed key."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
from scipy.stats import chi2_contingency

from specserve.models.probs import SEED_KEY_ENV, seed_key_from_hex


def suite_seed_key() -> bytes:
    """The suite's pinned seed key (tests/conftest.py) for a target a test builds itself: with it a sampled test draws
    the same sample on every run, so its p-value belongs to the code, not to the run (an engine's own random key gave
    each of the ~60 chi-square tests a 1 in 1000 chance to fail a sound build on any run)."""
    return seed_key_from_hex(os.environ[SEED_KEY_ENV])


def two_sample_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Pearson's chi-square of homogeneity for two samples of tokens (a 2 x bins contingency table):
    a bin per token seen ``min_count`` times over both samples, the rest pooled into one bin."""
    common = sorted(t for t in set(a) | set(b) if a[t] + b[t] >= min_count)
    rows = []
    for sample in (a, b):
        total = sum(sample.values())
        rows.append([sample[t] for t in common] + [total - sum(sample[t] for t in common)])
    table = np.array(rows, dtype=float)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table, correction=False).pvalue)
