"""Hugging Face's own loading bars stay off under the bench's (they wrote 'Loading weights: 100%|...' into its
output, terminal or not)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_the_transformers_baseline_loads_without_a_bar_of_its_own(bench_target, bench_draft_lm, capfd):
    import torch
    from transformers.utils import logging as hf_logging

    from specserve.bench.hf_baseline import HFBaseline

    hf_logging.enable_progress_bar()  # as a fresh process starts (another test may have turned it off)
    capfd.readouterr()
    hf = HFBaseline(bench_target, "cpu", torch.float32, eos_token_ids=(0,), k=2)
    hf.load_assistant(bench_draft_lm)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
