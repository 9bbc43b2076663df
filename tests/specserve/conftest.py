"""Session fixtures for the bench tests: tiny random checkpoints (see bench_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import torch

from bench_helpers import DRAFT_LM, TARGET, save_checkpoint, save_eagle3


@pytest.fixture(scope="session")
def bench_target(tmp_path_factory) -> Path:
    return save_checkpoint("deepseek_v3", TARGET, tmp_path_factory.mktemp("bench") / "target")


@pytest.fixture(scope="session")
def bench_draft_lm(tmp_path_factory) -> Path:
    return save_checkpoint("llama", DRAFT_LM, tmp_path_factory.mktemp("bench") / "draft_lm")


@pytest.fixture(scope="session")
def bench_eagle3(tmp_path_factory) -> Path:
    return save_eagle3(tmp_path_factory.mktemp("bench") / "eagle3")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny CPU ops run faster on one thread (torch's pool spins on a loaded 2-core box)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
