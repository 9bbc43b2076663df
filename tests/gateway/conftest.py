"""Fixtures for the service tests (helpers in service_helpers.py).

    tiny_target_dir -> Path        qwen3_moe, vocab 256, hidden 64, 2 layers, eos None, + byte tokenizer.json
    byte_tokenizer -> Tokenizer    that tokenizer.json's tokenizer (ids 0..255, one byte each)
    otlp_receiver -> OtlpReceiver  a real OTLP collector: .endpoint, .snapshot() -> [SpanRecord], .metric_names
"""

from __future__ import annotations

from pathlib import Path

import pytest
from service_helpers import OtlpReceiver
from tiny_hf import save_tiny_hf


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
    config = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.2,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
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
