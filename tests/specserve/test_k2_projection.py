"""specserve.bench.k2_projection (`specserve bench project`): the arithmetic on hand-made shard / collective timings,
the labels, and bad input as one line (exit 2). The inputs are hand-made, not measurements."""

from __future__ import annotations

import json

import pytest

from specserve.bench import k2_projection
from specserve.bench.k2_projection import PUBLISHED_ALLREDUCE, build, format_lines
from specserve.bench.projection import ProjectionError
from specserve.cli.main import main as cli_main


def main(argv: list[str]) -> int:
    return cli_main(["bench", "project", *argv])


LM_HEAD = 40960 * 7168 * 2


def _rows(layers: int, context: int = 10240, max_k: int = 8) -> list[dict]:
    # step = 1.0 + 0.1 k (fixed) + layers x (0.12 + 0.002 k) ms; step_bench's row context = cached + k
    return [
        {"context": context - 1 + k, "k": k, "graph_ms": 1.0 + 0.1 * k + layers * (0.12 + 0.002 * k)}
        for k in range(max_k + 1)
    ]


def _shard_report(layer_counts=(1, 4), rows=_rows) -> dict:
    return {
        "device_name": "hand-made",
        "bandwidth": {"bytes_per_s": 4.0e12},
        "results": [
            {"model": "kimi-k2-layer", "rows": rows(1)},  # not a shard: ignored
            *(
                {
                    "model": f"kimi-k2-layer-int4:{n}",
                    "layers": n,
                    "shard": {"rank": 0, "size": 4, "ep": True},
                    "lm_head_bytes": LM_HEAD,
                    "rows": rows(n),
                }
                for n in layer_counts
            ),
        ],
    }


def _allreduce(world: int = 4, tokens=(1, 2, 4, 8, 16)) -> dict:
    return {
        "world_size": world,
        "hidden": 7168,
        "backend": "nccl",
        "device": "hand-made",
        "date_utc": "-",
        "all_reduce": [{"tokens": t, "median_us": 10.0 + t, "mode": "cuda_graph"} for t in tokens],
        "all_gather_logits": [{"tokens": t, "median_us": 20.0 + t} for t in tokens],
    }


METHODS = {
    "target-only": {"kind": "specserve", "drafter": "none", "speculation": "fixed", "k": 0},
    "eagle3/fixed/k2": {
        "kind": "specserve",
        "drafter": "eagle3",
        "speculation": "fixed",
        "draft_ahead": False,
        "k": 2,
        "acceptance_by_position": {"conditional": [0.5, 0.5]},
    },
}


def test_step_is_fixed_plus_layers_plus_collectives_hand_computed():
    out = build(_shard_report(), _allreduce(), METHODS, [])
    s0 = out["projection_step_ms_by_k"]["0"]
    assert s0["fixed_ms"] == pytest.approx(1.0) and s0["per_layer_ms"] == pytest.approx(0.12)
    # 1.0 + 61 x 0.12 + 122 all-reduces x 11 us + one logits gather of 21 us
    assert s0["step_ms"] == pytest.approx(1.0 + 7.32 + 1.342 + 0.021)
    s3 = out["projection_step_ms_by_k"]["3"]  # T = 4: all-reduce 14 us, gather 24 us
    assert s3["step_ms"] == pytest.approx(1.3 + 61 * 0.126 + 122 * 14e-3 + 24e-3)
    s2 = out["projection_step_ms_by_k"]["2"]  # T = 3 lies between the measured T = 2 and 4: linear
    assert s2["all_reduce_us_per_call"] == pytest.approx(13.0)
    # tokens/s through projection.project: E[emitted | k=2] = 1 + 0.5 + 0.25 over the projected step
    points = {p["k"]: p for p in out["projection_tokens_per_s_by_k"]["eagle3/fixed/k2"]}
    assert sorted(points) == [0, 1, 2]
    assert points[2]["tokens_per_s"] == pytest.approx(1.75e3 / s2["step_ms"], rel=1e-4)
    assert out["projection_target_only_tokens_per_s"] == pytest.approx(1e3 / s0["step_ms"], rel=1e-4)
    assert out["projection_best_k"]["eagle3/fixed/k2"]["k"] == 2
    assert out["projection_model"]["lm_head_shard_floor_ms"] == pytest.approx(LM_HEAD / 4.0e12 * 1e3, rel=1e-3)
    assert out["projection_vs_record"]["k3_tokens_4"]["record"] == [8.0, 9.3]


def test_every_key_and_line_is_labelled_projection():
    out = build(_shard_report(), None, METHODS, [])
    assert all(key.startswith("projection") for key in out)
    lines = format_lines(out)
    assert lines and all(line.startswith("projection") for line in lines)
    text = "\n".join(lines)
    assert "PROJECTION, not a measurement" in text and "511.6" in text and "4 x NVIDIA B200" in text
    # no measurement given: the published figure, with its source, for every T
    assert out["projection_step_ms_by_k"]["0"]["all_reduce_us_per_call"] == PUBLISHED_ALLREDUCE["us_per_call"]
    assert "NVIDIA/nccl" in out["projection_inputs"]["collectives"]
    assert any("H100 not H200" in note for note in out["projection_notes"])


def test_widths_without_a_collective_time_are_left_out_with_a_note():
    out = build(_shard_report(), _allreduce(tokens=(1, 2, 4)), METHODS, [])
    assert sorted(map(int, out["projection_step_ms_by_k"])) == [0, 1, 2, 3]
    assert any("T = 5" in note for note in out["projection_notes"])


@pytest.mark.parametrize(
    "shard, allreduce, summary, message",
    [
        (None, None, "ok", "does not exist"),
        ({"results": [{"model": "qwen3-30b-a3b", "rows": _rows(1)}]}, None, "ok", "no shard rows"),
        (_shard_report(layer_counts=(4,)), None, "ok", "one layer count"),
        (_shard_report(rows=lambda n: _rows(5 - n)), None, "ok", "does not grow with layers"),
        (_shard_report(), _allreduce(world=2), "ok", "2 ranks"),
        (_shard_report(), {"world_size": 4}, "ok", "malformed"),
        (_shard_report(), None, "bad", "not a bench summary"),
        (_shard_report(), None, "no-drafter", "no fixed-k drafter"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, shard, allreduce, summary, message):
    argv = [
        "--shard-step",
        str(tmp_path / "step_bench.json"),
        "--acceptance",
        str(tmp_path / "summary.json"),
        "--out",
        str(tmp_path / "out"),
    ]
    if shard is not None:
        (tmp_path / "step_bench.json").write_text(json.dumps(shard))
    if allreduce is not None:
        (tmp_path / "allreduce.json").write_text(json.dumps(allreduce))
        argv += ["--allreduce", str(tmp_path / "allreduce.json")]
    methods = {"ok": METHODS, "no-drafter": {"target-only": METHODS["target-only"]}}.get(summary)
    (tmp_path / "summary.json").write_text(json.dumps({"methods": methods} if methods else [1, 2]))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specserve bench: error:") and message in err, err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_cli_writes_the_labelled_json_and_picks_the_context(tmp_path, capsys):
    two = {
        "device_name": "hand-made",
        "results": [
            {
                "model": f"kimi-k2-layer-int4:{n}",
                "layers": n,
                "shard": {"rank": 0, "size": 4},
                "rows": _rows(n, context=128) + _rows(n, context=10240),
            }
            for n in (1, 2)
        ],
    }
    (tmp_path / "step_bench.json").write_text(json.dumps(two))
    (tmp_path / "summary.json").write_text(json.dumps({"methods": METHODS}))
    (tmp_path / "steps.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in (
                {"method": "eagle3/fixed/k2", "drafted": 2, "accepted": 1},
                {"method": "eagle3/fixed/k2", "drafted": 2, "accepted": 2},
            )
        )
    )
    base = [
        "--step",
        str(tmp_path / "step_bench.json"),
        "--acceptance",
        str(tmp_path / "summary.json"),
        "--out",
        str(tmp_path / "proj"),
    ]
    assert main(base) == 0
    out = json.loads((tmp_path / "proj" / "summary.json").read_text())
    assert out["bench"] == "project" and out["environment"]["git"]
    assert out["projection_inputs"]["context"] == 10240  # default: the largest step_bench --contexts value
    replay = out["projection_per_method"]["eagle3/fixed/k2"]  # its steps replayed at the projected step times
    step2 = out["projection_step_ms_by_k"]["2"]["step_ms"]
    assert replay["tokens_per_s"] == pytest.approx(5 * 1e3 / (2 * step2), rel=1e-3)
    *lines, artifacts = capsys.readouterr().out.splitlines()
    assert all(line.startswith("projection") for line in lines) and artifacts.startswith("artifacts:")
    assert main(base + ["--context", "128"]) == 0
    assert json.loads((tmp_path / "proj" / "summary.json").read_text())["projection_inputs"]["context"] == 128
    assert main(base + ["--context", "999"]) == 2
    assert "no context 999" in capsys.readouterr().err


def test_shard_fit_refuses_mixed_shards():
    report = _shard_report()
    report["results"][2]["shard"] = {"rank": 1, "size": 4}
    with pytest.raises(ProjectionError, match="mix shards"):
        k2_projection.shard_fit(report)


def test_three_layer_counts_fit_by_least_squares_with_a_residual():
    def bent(n: int) -> list[dict]:  # the 2-layer point 0.3 ms above the line through 1 and 4 layers
        return [dict(r, graph_ms=r["graph_ms"] + (0.3 if n == 2 else 0.0)) for r in _rows(n, max_k=0)]

    fit = k2_projection.shard_fit(_shard_report(layer_counts=(1, 2, 4), rows=bent))["by_k"][0]
    # least squares over x = 1, 2, 4 (mean 7/3, Sxx 14/3): the bump moves the slope by 0.3 x (2 - 7/3) / (14/3)
    assert fit["per_layer_ms"] == pytest.approx(0.12 - 0.3 / 14, rel=1e-6)
    assert fit["max_abs_residual_ms"] == pytest.approx(0.3 * (1 - 1 / 3 - (1 / 9) / (14 / 3)))  # at 2 layers
    assert k2_projection.shard_fit(_shard_report())["by_k"][0]["max_abs_residual_ms"] == pytest.approx(0.0, abs=1e-9)


def test_a_layer_is_priced_by_the_replays_and_the_host_jitter_stays_fixed():
    """Rows with the replays' device time: the slope is the replays' (0.12 ms a layer), not the host-inclusive graph
    step's, whose host part (0.2 ms at 1 layer, 0.5 at 4: jitter, not a layer's work) would price a layer 0.1 ms
    dearer and multiply that by 61; the fixed part is the graph step less the layers, averaged."""

    def jittery(n: int) -> list[dict]:
        host = 0.2 if n == 1 else 0.5
        return [dict(r, replay_ms=r["graph_ms"], graph_ms=r["graph_ms"] + host) for r in _rows(n, max_k=0)]

    fit = k2_projection.shard_fit(_shard_report(rows=jittery))["by_k"][0]
    assert fit["per_layer_ms"] == pytest.approx(0.12) and fit["per_layer_from"] == "replay_ms"
    assert fit["fixed_ms"] == pytest.approx(1.0 + 0.35)
    plain = k2_projection.shard_fit(_shard_report())["by_k"][0]  # hand-made rows without replays: graph_ms alone
    assert plain["per_layer_from"] == "graph_ms" and plain["per_layer_ms"] == pytest.approx(0.12)
