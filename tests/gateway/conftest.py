"""Fixtures for the service tests (helpers in service_helpers.py).

tiny_target_dir -> Path        qwen3_moe, vocab 256, hidden 64, 2 layers, eos None, + byte tokenizer.json
byte_tokenizer -> Tokenizer    that tokenizer.json's tokenizer (ids 0..255, one byte each)
otlp_receiver -> OtlpReceiver  a real OTLP collector: .endpoint, .snapshot() -> [SpanRecord], .metric_names
"""

from __future__ import annotations

from pathlib import Path

import pytest
from service_helpers import OtlpReceiver
from tiny_hf import TINY_BASE, TINY_QWEN3_MOE, save_tiny_hf


def _byte_tokenizer():
    """256 byte-level tokens (ids 0..255), no merges: every model token decodes to one byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gw_ckpt") / "target"
    config = dict(TINY_BASE, **TINY_QWEN3_MOE, mlp_only_layers=[])
    save_tiny_hf("qwen3_moe", config, out)
    _byte_tokenizer().save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="session")
def byte_tokenizer():
    return _byte_tokenizer()


@pytest.fixture(scope="module")
def otlp_receiver():
    r = OtlpReceiver()
    yield r
    r.close()
