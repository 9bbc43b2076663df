"""Suite-wide settings: one torch thread per test process (tiny models gain nothing from more, and
CI has two cores shared with the service processes the tests start)."""

import torch

torch.set_num_threads(1)
