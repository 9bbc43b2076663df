"""The drafter census (specserve/bench/draft_profile.py) on the CPU: real demo target, real n-gram drafter."""

from __future__ import annotations

import json

import pytest

from specserve.bench import draft_profile


def test_profiles_a_drafter_and_writes_its_row(tmp_path, capsys):
    out = tmp_path / "draft_profile.json"
    assert draft_profile.main(["--drafters", "ngram", "--max-new-tokens", "8", "--top", "4", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["drafter"] == "ngram" and row["proposes"] > 0 and row["propose_ms_median"] > 0
    assert row["mean_accepted_length"] >= 1.0
    assert 0 < len(row["host_profile"]) <= 4 and all(h["own_us_per_propose"] >= 0 for h in row["host_profile"])
    assert "ngram k=4 (cpu, float32)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--drafters", "medusa"], "--drafters: choose from"),
    (["--k", "0"], "--k must be >= 1"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        draft_profile.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
