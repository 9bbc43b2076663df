"""Prompt-lookup drafting: hand-made cases, min/max n, and the proposer's sync bookkeeping."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.drafter_errors import DrafterConfigError, ProposerError
from specserve.draft_service.ngram import NgramProposer, find_ngram_continuation
from specserve.draft_service.registry import PROPOSER_FACTORIES, build_proposer


def cont(ids, min_n=1, max_n=4, k=4):
    return find_ngram_continuation(np.asarray(ids, dtype=np.int64), min_n, max_n, k)


def test_docstring_example():
    assert cont([5, 7, 9, 2, 4, 8, 7, 9, 2], 1, 3, 4) == (4, 8, 7, 9)


def test_repeated_code_block_is_proposed_in_full():
    block = list(range(100, 130))  # a 30-token code block
    prompt = [1, 2, 3] + block + [7, 8, 9]
    seq = prompt + block[:3]  # the model starts repeating the block
    assert cont(seq, 1, 3, k=27) == tuple(block[3:])


def test_longest_match_wins_over_more_recent_shorter():
    # suffix "3 4 5": the 3-gram occurs at the start, a more recent 1-gram "5" is followed by 99
    seq = [3, 4, 5, 10, 11, 5, 99, 3, 4, 5]
    assert cont(seq, 1, 3, 2) == (10, 11)


def test_most_recent_among_equal_length():
    seq = [1, 2, 10, 1, 2, 20, 1, 2]
    assert cont(seq, 2, 2, 1) == (20,)


def test_min_n_respected():
    seq = [1, 2, 3, 9, 8, 7, 3]  # only a 1-gram match ("3")
    assert cont(seq, 1, 4, 2) == (9, 8)
    assert cont(seq, 2, 4, 2) == ()


def test_max_n_caps_the_match_length():
    # with max_n=1 the most recent "2" wins (-> 50); with max_n=2 the 2-gram "1 2" wins (-> 40)
    seq = [1, 2, 40, 7, 2, 50, 1, 2]
    assert cont(seq, 1, 1, 1) == (50,)
    assert cont(seq, 1, 2, 1) == (40,)


def test_periodic_continuation_extends_past_the_end():
    assert cont([1, 2, 1, 2, 1, 2], 1, 3, 5) == (1, 2, 1, 2, 1)
    assert cont([7, 7, 7], 1, 2, 3) == (7, 7, 7)


def test_no_match_and_tiny_inputs():
    assert cont([1, 2, 3, 4]) == ()
    assert cont([5]) == ()


def test_matches_brute_force_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, 4, size=rng.integers(2, 40))
        min_n, max_n, k = 1 + rng.integers(0, 2), 2 + rng.integers(0, 3), 1 + rng.integers(0, 5)
        L = len(ids)
        best, best_end = 0, -1
        for end in range(L - 1):  # brute force: longest (capped) match, most recent on ties
            n = 0
            while n < max_n and end - n >= 0 and ids[end - n] == ids[L - 1 - n]:
                n += 1
            if n >= best and n > 0:
                best, best_end = n, end
        if best < min_n:
            want = ()
        else:
            full = list(ids)
            for j in range(k):
                full.append(full[best_end + 1 + j])
            want = tuple(full[L:])
        assert cont(ids, min_n, max_n, k) == want, (ids.tolist(), min_n, max_n, k)


def test_proposer_sync_and_info():
    p = build_proposer(DrafterConfig(family="ngram", max_block_size=4, ngram_min_n=2, ngram_max_n=3))
    assert isinstance(p, NgramProposer)
    assert p.info.family == "ngram" and not p.info.has_probs and not p.info.needs_hidden_states
    assert p.info.hidden_layers == () and not p.info.supports_tree
    p.start("s", [1, 2, 3, 4, 5, 1, 2], None, SamplingParams())
    block = p.propose("s", 7, [], None, 3)
    assert block.token_ids == (3, 4, 5) and block.probs is None and block.is_chain
    # target accepted 2 drafted tokens and emitted 9: both ways of telling it agree
    b1 = p.propose("s", 7, [3, 4, 9], None, 2)
    assert p.session("s").ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]
    assert b1.token_ids == ()
    p.release("s")
    p.start("s", [1, 2, 3, 4, 5, 1, 2], None, SamplingParams())
    p.propose("s", 7, [], None, 3)
    p.propose("s", 9, [9], None, 2)  # prefix counts the 2 accepted drafted tokens
    assert p.session("s").ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 4, 9]


def test_bad_calls_raise_clear_errors():
    p = build_proposer(DrafterConfig(family="ngram", max_block_size=4))
    with pytest.raises(ProposerError, match="unknown session"):
        p.propose("nope", 1, [], None, 2)
    p.start("s", [1, 2], None, SamplingParams())
    with pytest.raises(ProposerError, match="already started"):
        p.start("s", [1, 2], None, SamplingParams())
    with pytest.raises(ProposerError, match="prefix_len"):
        p.propose("s", 5, [], None, 2)
    with pytest.raises(ProposerError, match="num_tokens"):
        p.propose("s", 2, [], None, -1)
    with pytest.raises(ProposerError, match="token id -1"):
        p.propose("s", 2, [-1], None, 2)
    p.release("s")
    p.release("s")  # idempotent
    assert p.active_sessions == 0
    with pytest.raises(DrafterConfigError, match="unknown drafter family"):
        build_proposer(DrafterConfig(family="medusa"))
    with pytest.raises(DrafterConfigError, match="ngram_min_n"):
        DrafterConfig(family="ngram", ngram_min_n=3, ngram_max_n=2)
    assert set(PROPOSER_FACTORIES) == {"ngram", "model", "eagle3", "dflash", "dspark", "mtp"}


def test_ngram_reports_target_vocab(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 11}))
    p = build_proposer(DrafterConfig(family="ngram", target_checkpoint=tmp_path))
    assert p.info.vocab_size == 11 and p.info.vocab_hash == "size:11"
    p.start("s", [1, 2], None, SamplingParams())
    with pytest.raises(ProposerError, match="token id 11"):
        p.propose("s", 2, [11], None, 1)
