"""`specserve bench`: byte-floor arithmetic on hand-computed cases, the model's bytes by role, the
aggregation helpers, and the artifact schema of a real (tiny, CPU) run."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_helpers import TARGET, read_jsonl

from specserve.bench.config import (
    BenchConfig,
    BenchConfigError,
    MethodSpec,
    plan_methods,
)
from specserve.bench.floors import (
    FloorError,
    ModelBytes,
    achieved_fraction,
    expert_bytes,
    floor_ms,
    fp8_linear_bytes,
    int4_linear_bytes,
    kv_bytes,
    step_bytes,
)
from specserve.bench.projection import (
    ProjectionError,
    ShapeTimings,
    load_shape_timings,
    project,
    save_shape_timings,
    timings_from_verify_tax,
)
from specserve.bench.prompts import PromptSetError, load_prompt_set
from specserve.bench.summary import acceptance_by_position


# ---------------------------------------------------------------- floors (pure arithmetic)
def _mb(**over) -> ModelBytes:
    kw = dict(
        dense_bytes={"attention": 1000, "lm_head": 500},
        embedding_row_bytes=8,
        expert_bytes=300,
        num_moe_layers=2,
        num_experts=4,
        kv_entry_bytes=10,
        num_layers=3,
    )
    kw.update(over)
    return ModelBytes(**kw)


def test_expert_and_kv_bytes_hand_computed():
    assert expert_bytes(hidden_size=64, intermediate_size=32, dtype_bytes=2) == 3 * 64 * 32 * 2 == 12288
    assert expert_bytes(2048, 768, 2) == 9_437_184  # a Qwen3-30B-A3B expert in bf16
    assert kv_bytes(context_len=100, kv_entry_bytes=10, num_layers=3) == 3000


def test_quantized_weight_bytes_hand_computed():
    # a Kimi-K2 expert's gate [2048, 7168] in int4 groups of 32: 896 int32 words + 224 bf16 scales per row
    assert int4_linear_bytes(2048, 7168, 32) == 2048 * (896 * 4 + 224 * 2) == 8_257_536
    assert int4_linear_bytes(3, 40, 32) == 3 * (5 * 4 + 2 * 2)  # a partial last word and group
    # DeepSeek-V3 kv_a [576, 7168] in fp8 blocks of 128: a 5 x 56 float32 scale (the last row block partial)
    assert fp8_linear_bytes(576, 7168, (128, 128)) == 576 * 7168 + 5 * 56 * 4
    assert fp8_linear_bytes(576, 7168, (128, 128), scale_bytes=2) == 576 * 7168 + 5 * 56 * 2
    with pytest.raises(FloorError):
        int4_linear_bytes(0, 7168, 32)


def test_step_bytes_and_floor_hand_computed():
    sb = step_bytes(_mb(), num_tokens=5, experts_touched=7, context_len=20)
    assert (sb.dense, sb.embedding, sb.experts, sb.kv) == (1500, 40, 2100, 600)
    assert sb.total == 4240
    assert floor_ms(sb.total, bandwidth_bytes_per_s=4240e3) == pytest.approx(1.0)  # 4240 B at 4.24 MB/s = 1 ms
    assert achieved_fraction(1.0, 4.0) == 0.25
    assert achieved_fraction(1.0, 0.0) is None


def test_floor_refuses_impossible_steps():
    with pytest.raises(FloorError):
        step_bytes(_mb(), num_tokens=1, experts_touched=9, context_len=1)  # only 2 layers x 4 experts exist
    with pytest.raises(FloorError):
        step_bytes(_mb(), num_tokens=0, experts_touched=0, context_len=1)
    with pytest.raises(FloorError):
        floor_ms(10, 0.0)
    with pytest.raises(FloorError):
        _mb(dense_bytes={"mystery": 1})


def test_model_bytes_counts_the_loaded_model_by_role(bench_target):
    from specserve.bench.model_bytes import model_bytes
    from specserve.models.loader import load_model

    model, config = load_model(bench_target, progress=False)
    mb = model_bytes(model, config)
    t, f32 = TARGET, 4
    h, v, layers = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    heads, qr, kvr = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
    nope, rope, vd = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    attn = qr * h + heads * (nope + rope) * qr + (kvr + rope) * h + heads * (nope + vd) * kvr + h * heads * vd
    moe_layers = layers - t["first_k_dense_replace"]
    inter = t["moe_intermediate_size"]
    assert mb.dense_bytes["attention"] == layers * attn * f32
    assert mb.dense_bytes["norm"] == (layers * (2 * h + qr + kvr) + h) * f32
    assert mb.dense_bytes["router"] == moe_layers * (t["n_routed_experts"] * h + t["n_routed_experts"]) * f32
    assert mb.dense_bytes["dense_mlp"] == 3 * h * t["intermediate_size"] * f32
    assert mb.dense_bytes["shared_experts"] == moe_layers * 3 * h * inter * t["n_shared_experts"] * f32
    assert mb.dense_bytes["lm_head"] == v * h * f32
    assert mb.embedding_row_bytes == h * f32
    assert mb.expert_bytes == expert_bytes(h, inter, f32)
    assert (mb.num_moe_layers, mb.num_experts) == (moe_layers, t["n_routed_experts"])
    assert mb.kv_entry_bytes == (kvr + rope) * f32
    all_params = sum(p.numel() * p.element_size() for p in model.parameters())
    routed = mb.expert_bytes * mb.max_experts
    assert mb.param_bytes_total == all_params == mb.dense_total + routed + v * h * f32  # + the embedding


# ---------------------------------------------------------------- aggregation helpers
def test_acceptance_by_position_hand_computed():
    steps = [{"drafted": 3, "accepted": 3}, {"drafted": 3, "accepted": 1}, {"drafted": 2, "accepted": 0}]
    acc = acceptance_by_position(steps)
    assert acc["drafted_count"] == [3, 3, 2]
    assert acc["marginal"] == [round(2 / 3, 4), round(1 / 3, 4), 0.5]
    # position 1 reached by steps 1 and 2 (step 3 stopped at 0); position 2 reached only by step 1
    assert acc["conditional"] == [round(2 / 3, 4), 0.5, 1.0]


def test_projection_combines_measured_step_times_with_acceptance():
    timings = ShapeTimings("X", "test", "gpu", {0: 10.0, 1: 11.0, 2: 12.0, 4: 14.0}, {})
    out = project(timings, {"m": [0.5, 0.5, None]})
    assert out["label"] == "projection"
    assert out["baseline_tokens_per_s"] == 100.0
    assert [p["k"] for p in out["methods"]["m"]] == [0, 1, 2]  # k=4 needs acceptance beyond position 2
    assert out["methods"]["m"][2]["tokens_per_s"] == pytest.approx(1.75 * 1e3 / 12.0, rel=1e-4)


def test_projection_timings_file_round_trip(tmp_path):
    points = [{"k": 0, "verify_ms_median": 4.0}, {"k": 2, "verify_ms_median": 5.0}]
    timings = timings_from_verify_tax(points, "Qwen3-30B-A3B (synthetic)", "unit test", "none")
    save_shape_timings(timings, tmp_path / "t.json")
    assert load_shape_timings(tmp_path / "t.json") == timings
    with pytest.raises(ProjectionError):
        ShapeTimings("X", "", "", {1: 2.0}, {})  # no k=0 baseline
    # the step_bench.json layout (GPU synthetic-model run); hand-made rows, not a measurement
    report = {
        "device_name": "test",
        "results": [
            {"model": "kimi-k2-layer", "error": "out of memory"},
            {
                "model": "qwen3-30b-a3b",
                "rows": [
                    {"context": 127, "k": 0, "graph_ms": 2.0},
                    {"context": 128, "k": 1, "graph_ms": 2.5},
                    {"context": 4095, "k": 0, "graph_ms": 3.0},
                ],
            },
        ],
    }
    (tmp_path / "step_bench.json").write_text(json.dumps(report))
    got = load_shape_timings(tmp_path / "step_bench.json")
    assert dict(got.verify_ms_by_k) == {0: 2.0, 1: 2.5} and "qwen3-30b-a3b" in got.shape
    assert dict(load_shape_timings(tmp_path / "step_bench.json", context=4095).verify_ms_by_k) == {0: 3.0}
    with pytest.raises(ProjectionError):
        load_shape_timings(tmp_path / "step_bench.json", model="kimi-k2-layer")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ProjectionError):
        load_shape_timings(tmp_path / "bad.json")


def test_prompt_set_is_pinned_and_interleaved():
    full = load_prompt_set()
    assert 8 <= len(full.prompts) <= 16 and len(full.sha256) == 64
    assert {p.kind for p in full.prompts} == {"code", "prose"}
    assert [p.kind for p in load_prompt_set(limit=2).prompts] == ["code", "prose"]
    with pytest.raises(PromptSetError):
        load_prompt_set(limit=len(full.prompts) + 1)


def test_prose_set_is_pinned_natural_language_and_taken_by_name():
    """prose-v1 (issue #43): English prose only, no code; pinned by its bytes (an edit changes the fingerprint and
    fails here: add prose-v2.json instead); `bench --prompt-set prose-v1` runs it."""
    from specserve.cli.bench_e2e import add_arguments

    prose = load_prompt_set("prose-v1")
    assert prose.sha256 == "52cafc6ba1aec95cb77993ec156c9fad87a096b1e0d2f861c6ae9e09de3a389c"
    assert len(prose.prompts) == 12 and {p.kind for p in prose.prompts} == {"prose"}
    code_marks = ("def ", "import ", "class ", '"""', "()", "):", "    ", "=")
    assert not [p.id for p in prose.prompts if any(m in p.text for m in code_marks)]
    assert not {p.text for p in prose.prompts} & {p.text for p in load_prompt_set().prompts}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--prompt-set", "prose-v1"]).prompt_set == "prose-v1"


def test_plan_skips_draft_ahead_for_hidden_state_drafters(tmp_path):
    cfg = BenchConfig(
        model=tmp_path,
        out=tmp_path,
        drafters=("none", "ngram", "eagle3"),
        speculation=("fixed", "adaptive"),
        draft_ahead=(False, True),
    )
    methods, skipped = plan_methods(cfg, {"ngram": True, "eagle3": True}, {"eagle3": True})
    names = [m.name for m in methods]
    assert names[0] == "target-only" and "ngram/adaptive/ahead" in names
    assert "eagle3/fixed/k4" in names and "eagle3/fixed/k4/ahead" not in names
    assert {s.method for s in skipped} == {"eagle3/fixed/k4/ahead", "eagle3/adaptive/ahead"}
    assert MethodSpec("model", adaptive=True, k=4).name == "model/adaptive"
    with pytest.raises(BenchConfigError):
        BenchConfig(model=tmp_path, out=tmp_path, drafters=("medusa",))
    with pytest.raises(BenchConfigError):
        BenchConfig(model=tmp_path / "absent", out=tmp_path)
    with pytest.raises(BenchConfigError):
        BenchConfig(model=tmp_path, out=tmp_path, device="tpu")


def test_cli_flags_map_onto_the_config(bench_target, tmp_path):
    from specserve.cli.bench_e2e import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(bench_target),
            "--draft-models",
            f"model={tmp_path},eagle3={tmp_path}",
            "--speculation",
            "both",
            "--draft-ahead",
            "off",
            "--k-sweep",
            "4,0,2",
            "--out",
            str(tmp_path),
        ]
    )
    cfg = config_from_args(args)
    assert cfg.speculation == ("fixed", "adaptive") and cfg.draft_ahead == (False,)
    assert cfg.k_sweep == (0, 2, 4) and set(cfg.draft_models) == {"model", "eagle3"} and not cfg.demo_drafters
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-models", "model"])


# ---------------------------------------------------------------- a real run: the artifact schema
STEP_KEYS = {
    "method",
    "drafter",
    "speculation",
    "draft_ahead",
    "prompt",
    "step",
    "context_len",
    "drafted",
    "accepted",
    "draft_ms",
    "verify_ms",
    "verify_wall_ms",
    "wall_ms",
    "overhead_ms",
    "experts_touched",
    "floor_bytes",
    "floor_ms",
    "k",
}
METHOD_KEYS = {"kind", "prompts", "completion_tokens", "tokens_per_s", "ttft_s_mean", "matches_target_only"}
SPEC_KEYS = METHOD_KEYS | {
    "steps",
    "mean_accepted_length",
    "acceptance_by_position",
    "chosen_k",
    "per_step_ms",
    "floor_fraction_of_step",
    "draft_ahead_stats",
    "experts_touched_mean",
    "draft_ms_per_drafted_token",
}


def test_artifacts_exist(bench_run):
    out, summary = bench_run
    blocks = (out / "table.md").read_text().split("\n\n")
    table = blocks[0].splitlines()
    assert len(table) == 2 + len(summary["methods"]) and table[2].startswith("| target-only | ")
    for rel in summary["plots"]:
        assert (out / rel).stat().st_size > 1000 and rel.endswith(".png")
    assert {"plots/tokens_per_s.png", "plots/verify_tax.png", "plots/phase_breakdown.png"} <= set(summary["plots"])
    env = summary["environment"]
    assert {"versions", "git", "gpu", "device", "cpu"} <= env.keys() and env["versions"]["torch"]
    assert env["bandwidth"]["bytes_per_s"] > 0
    assert summary["engine"]["attention"] and summary["engine"]["experts_fn"]
    proj = summary["projection"]
    assert proj["included"] and proj["label"] == "projection" and "plots/projection.png" in summary["plots"]
    # by-k curves: each drafter's fixed, no-draft-ahead method with the largest k
    assert set(proj["methods"]) == {"ngram/fixed/k2", "model/fixed/k2", "eagle3/fixed/k2"}


def test_no_projection_without_synthetic_timings(tmp_path):
    from specserve.bench.bench import _projection

    cfg = BenchConfig(model=tmp_path, out=tmp_path)
    assert _projection(cfg, {})["included"] is False


def test_step_rows_and_method_summaries(bench_run):
    out, summary = bench_run
    steps = read_jsonl(out / "steps.jsonl")
    assert steps and all(STEP_KEYS <= row.keys() for row in steps)
    for row in steps:
        assert row["floor_ms"] > 0 and row["accepted"] <= row["drafted"] <= row["k"] <= 2
        assert row["overhead_ms"] == pytest.approx(row["wall_ms"] - row["draft_ms"] - row["verify_ms"], abs=1e-3)
    methods = summary["methods"]
    model_steps = [row for row in steps if row["method"] == "model/fixed/k2"]
    per_token = sum(r["draft_ms"] for r in model_steps) / sum(r["drafted"] for r in model_steps)
    assert methods["model/fixed/k2"]["draft_ms_per_drafted_token"] == pytest.approx(per_token, abs=1e-3)
    assert methods["target-only"]["draft_ms_per_drafted_token"] is None  # drafted nothing
    ours = [m for m in methods.values() if m["kind"] == "specserve"]
    assert {
        "target-only",
        "ngram/fixed/k1",
        "ngram/fixed/k2",
        "ngram/adaptive/ahead",
        "model/fixed/k1",
        "model/fixed/k2/ahead",
        "model/adaptive/ahead",
    } <= methods.keys()
    for m in ours:
        assert SPEC_KEYS <= m.keys()
        assert m["matches_target_only"] == 1.0  # greedy speculative decoding is lossless
        assert m["completion_tokens"] == 6
    assert methods["target-only"]["mean_accepted_length"] == 1.0
    assert methods["ngram/fixed/k2/ahead"]["draft_ahead"] is True and methods["ngram/fixed/k2"]["draft_ahead"] is False
    assert "hf/greedy" in methods and METHOD_KEYS <= methods["hf/greedy"].keys()
    assert "hf/assisted" in methods
    skipped = {s["method"] for s in summary["skipped"]}
    assert "dflash" in skipped  # no checkpoint was given
    reasons = {s["method"]: s["reason"] for s in summary["skipped"]}
    # mtp needs no folder, but this target's config names an MTP layer (transformers' default) it does not hold
    assert "holds no tensor of its multi-token-prediction layer (model.layers.3.*)" in reasons["mtp"]
    assert {"eagle3/fixed/k1", "eagle3/fixed/k2", "eagle3/adaptive"} <= methods.keys()  # reads target hidden states
    assert {"eagle3/fixed/k1/ahead", "eagle3/fixed/k2/ahead", "eagle3/adaptive/ahead"} <= skipped  # no draft-ahead
    requests = read_jsonl(out / "requests.jsonl")
    assert {r["method"] for r in requests} == methods.keys()


def test_verify_tax_curve(bench_run):
    out, summary = bench_run
    points = summary["verify_tax"]["points"]
    assert [p["k"] for p in points] == [0, 1, 3]
    mb = summary["model_bytes"]
    for p in points:
        assert p["verify_ms_median"] > 0 and 0 < p["experts_touched_median"] <= mb["num_moe_layers"] * mb["num_experts"]
        parts = p["floor_bytes_by_part"]
        assert parts["dense"] == mb["dense_total"] and sum(parts.values()) == p["floor_bytes"]
        assert parts["kv"] == summary["verify_tax"]["context_len"] * mb["kv_entry_bytes"] * mb["num_layers"]
        bw = summary["environment"]["bandwidth"]["bytes_per_s"]
        assert p["floor_ms"] == pytest.approx(p["floor_bytes"] / bw * 1e3, rel=1e-3)
    assert len(read_jsonl(out / "verify_tax.jsonl")) == 3 * 2
