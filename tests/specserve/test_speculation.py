"""k's one home (specserve/contract/speculation.py): a request's k on a draft, and a drafter's block size for k."""

from __future__ import annotations

import pytest

from specserve.contract.speculation import DEFAULT_K, MAX_K, KTooLong, block_size_for, k_on_draft
from specserve.contract.types import GenerationRequest


def test_a_request_runs_its_k_the_default_capped_at_the_draft_and_more_than_it_drafts_is_refused():
    assert k_on_draft(0, None) == DEFAULT_K  # no k asked, draft not known yet
    assert k_on_draft(0, 8) == DEFAULT_K
    assert k_on_draft(0, 2) == 2  # the default on a draft that drafts fewer
    assert k_on_draft(6, 8) == 6 and k_on_draft(8, 8) == 8
    assert k_on_draft(MAX_K, None) == MAX_K
    with pytest.raises(KTooLong, match="9 exceeds the draft's max_block_size of 8"):
        k_on_draft(9, 8)


def test_a_drafter_for_chains_of_k_drafts_one_more_and_the_contract_default_is_the_one_k():
    assert [block_size_for(k) for k in (0, 1, 4, 8)] == [2, 2, 5, 9]  # draft-ahead's guess of the bonus token
    assert GenerationRequest(prompt_ids=(1,), max_new_tokens=1).num_speculative_tokens == DEFAULT_K


def test_the_benchmarks_build_their_drafters_with_block_size_for(monkeypatch, tmp_path):
    """bench/config.py and bench/serve_overhead.py ask block_size_for (they wrote k + 1 of their own): a changed
    rule reaches them."""
    from specserve.bench import config as bench_config
    from specserve.bench.serve_overhead import OverheadConfig
    from specserve.contract import speculation

    monkeypatch.setattr(bench_config, "block_size_for", lambda k: 100 + k)
    monkeypatch.setattr(speculation, "block_size_for", lambda k: 200 + k)
    cfg = bench_config.BenchConfig(model=tmp_path, out=tmp_path / "out", num_speculative_tokens=3, fixed_ks=(2,))
    assert cfg.drafter_block_size == 103
    assert OverheadConfig(model=str(tmp_path), k=4).drafter_block_size == 204
