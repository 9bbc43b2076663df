"""Suite-wide settings: one torch thread per test process (tiny models gain nothing from more, and
CI has two cores shared with the service processes the tests start); and one pinned seed key for every target the
suite builds or starts, so that a seeded request draws the same values on every run, as it did before targets
keyed their seeds (a target's key is otherwise random per process: specserve/models/probs.py). The hostile tests
that need another key pass their own."""

import os

import torch

from specserve.models.probs import SEED_KEY_ENV

torch.set_num_threads(1)
os.environ.setdefault(SEED_KEY_ENV, "7e57" * 16)
