"""Two-sample test for the sampled (lossless) tests: are two samples of tokens drawn from one law?"""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chi2_contingency


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
