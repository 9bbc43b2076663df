"""Session fixtures for the bench tests: tiny random checkpoints (see bench_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
