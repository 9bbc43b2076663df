"""The drafter census (specserve/bench/draft_profile.py, its flags in tools/draft_profile.py) on the CPU: real demo target, real drafters."""

from __future__ import annotations

import json

import pytest

from specserve.bench import draft_profile
from specserve.tools.draft_profile import main


def test_profiles_drafters_and_writes_rows_of_the_schema(tmp_path, capsys):
    out = tmp_path / "draft_profile.json"
    argv = ["--drafters", "ngram,eagle3", "--max-new-tokens", "8", "--top", "4", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["drafter"] for r in rows] == ["ngram", "eagle3"]
    for row in rows:
        assert tuple(row) == draft_profile.ROW_KEYS
        assert row["model"] == "demo" and row["proposes"] > 0 and row["propose_ms_median"] > 0
        assert row["ms_per_drafted_token_median"] > 0 and row["mean_accepted_length"] >= 1.0
        assert 0 < len(row["host_profile"]) <= 4 and all(h["own_us_per_propose"] >= 0 for h in row["host_profile"])
        # a CPU launches no kernels: the device counts are null, not zero
        assert all(
            row[key] is None
            for key in (
                "kernels_per_propose",
                "kernels_per_drafted_token",
                "host_syncs_per_propose",
                "dtoh_copies_per_propose",
            )
        )
    text = capsys.readouterr().out
    assert "ngram k=4 on demo (cpu, float32)" in text and "n/a kernels per drafted token" in text


def test_profiles_trees(tmp_path, capsys):
    out = tmp_path / "draft_profile.json"
    argv = ["--drafters", "eagle3", "--tree", "6,2,3", "--max-new-tokens", "6", "--top", "2", "--out", str(out)]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tree"] == [6, 2, 3] and row["proposes"] > 0 and row["mean_accepted_length"] >= 1.0
    assert "eagle3 tree 6,2,3 on demo" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--drafters", "medusa"], "--drafters: choose from"),
        (["--k", "0"], "--k must be >= 1"),
        (["--model", "demo@no-such-shape"], "--model demo@no-such-shape:"),
        (["--tree", "6,2"], "--tree: want NUM_NODES,TOP_K,DEPTH"),
        (["--drafters", "dflash", "--tree", "6,2,3"], "--tree: dflash draft chains only"),
    ],
)
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
