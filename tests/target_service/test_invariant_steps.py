"""Token-count invariant steps on the CPU (issue #31): with `invariant_steps` a verify of k + 1 tokens gives, bit for
bit (torch.equal), the logits of k + 1 one-token decodes, for k = 0..15, and every node of a tree the logits of its
path verified as a chain; on the shipped demo in bf16 and float32 and on a tiny random preset. The negative control
runs the same checks with the option off and must see a difference. The GPU side is test_gpu_invariant_steps.py."""

from __future__ import annotations

import pytest
from invariance_helpers import chain_mismatches, engine_for, tree_mismatches

from specserve.paths import demo_checkpoint
from specserve.target_service.factory import CPU_ROWS, EngineConfig, build_engine

PROMPT = [5, 17, 101, 33, 64, 9, 150, 77, 3, 120, 41, 8, 199, 60, 21, 90, 14, 180, 2, 55]
CASES = [
    (str(demo_checkpoint("target")), "bfloat16"),
    (str(demo_checkpoint("target")), "float32"),
    ("synthetic:tiny-qwen3-moe", "bfloat16"),
    ("synthetic:tiny-kimi-k2", "float32"),
]


@pytest.mark.parametrize("model,dtype", CASES, ids=["demo-bf16", "demo-fp32", "tiny-qwen3-bf16", "tiny-kimi-fp32"])
def test_a_verify_gives_the_logits_of_its_decodes_bit_for_bit(model, dtype):
    engine = engine_for(model, dtype, invariant=True)
    assert engine.runner.invariant_rows == CPU_ROWS
    assert chain_mismatches(engine, PROMPT) == []
    assert tree_mismatches(engine, PROMPT) == []


def test_without_invariant_steps_a_verify_rounds_differently():
    """The negative control: the same checks with the option off see differences (float32 on the demo: torch's
    CPU GEMMs pick their kernel by row count)."""
    engine = engine_for(str(demo_checkpoint("target")), "float32", invariant=False)
    assert engine.runner.invariant_rows == 0
    assert chain_mismatches(engine, PROMPT) != []


def test_invariant_steps_refuse_a_backend_that_is_not_invariant():
    from specserve.models.attn_backend import AttentionBackendError

    with pytest.raises(AttentionBackendError, match="invariant steps need"):
        build_engine(
            EngineConfig(
                model="synthetic:tiny-qwen3-moe", attention_backend="torch", invariant_steps=True, num_kv_blocks=8
            )
        )


def test_a_padded_steps_summary_never_accepts_a_pad_row():
    """Pad rows repeat the last token and position: the graph's greedy summary stops at the last real row even where
    a pad row's token equals the target's choice before it."""
    import torch

    from specserve.target_service.engine.model_runner import chain_summary

    ids = torch.tensor([7, 3, 4, 4, 4])  # pending 7, drafted 3 and 4, then two pad rows
    pos = torch.tensor([10, 11, 12, 12, 12])
    logits = torch.nn.functional.one_hot(torch.tensor([3, 4, 4, 4, 9]), 16).float()
    assert chain_summary(ids, pos, logits, None, 0)[:2].tolist() == [2, 4]
    assert chain_summary(ids, torch.arange(10, 15), logits, None, 0)[:2].tolist() == [4, 9]  # unpadded: all accepted


def test_greedy_speculation_gives_target_only_tokens():
    from invariance_helpers import greedy_speculation

    engine = engine_for(str(demo_checkpoint("target")), "bfloat16", invariant=True)
    reference = engine.generate_greedy(PROMPT, 24)
    for k in (1, 4, 15):
        assert greedy_speculation(engine, PROMPT, reference, k) == reference, f"k = {k}"


def test_triton_steps_metadata_of_a_padded_step():
    """The Triton paged backend's invariant step metadata (host side, no kernel): a padded chain and a padded tree
    get their rows' paths in depth order; pad rows repeat the last token and position, write no slot (-1) and
    belong to no request (row_request -1: the kernels give them no keys and output 0)."""
    import torch

    from specserve.kernels.paged_attention import fixed_splits
    from specserve.kernels.paged_rows import tree_paths_of
    from specserve.models.attn_metadata import AttentionBatch
    from specserve.models.triton_paged_attention import RowsShape, RowsStep
    from specserve.target_service.engine.model_runner import pad_step

    step = RowsStep(RowsShape(1, 8, 8, 8, *fixed_splits(1024), paths=True), torch.device("cpu"), 2, 16)
    assert step.shape.num_splits == 16 and step.workspace.numel() == 8 * 2 * 16 * (16 + 2)  # rows x heads x splits
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    for mask in (None, tree):
        own = torch.ones(4, 4, dtype=torch.bool).tril() if mask is None else mask
        attn = AttentionBatch(
            query_lens=(4,),
            context_lens=(30,),
            block_tables=((3, 1, 2),),
            slot_mapping=torch.arange(50, 54),
            tree_masks=(mask,),
        )
        ids, pos, padded = pad_step([1, 2, 3, 4], [30, 31, 32, 32], attn, 8)
        assert (ids, pos, padded.slot_mapping.tolist()) == (
            [1, 2, 3, 4] + [4] * 4,
            [30, 31, 32, 32] + [32] * 4,
            [50, 51, 52, 53] + [-1] * 4,
        )
        assert padded.live_rows.tolist() == [4] and padded.pad_rows == 4
        step.fill(padded, 16)
        rows = step.rows
        paths, depth = tree_paths_of(own)
        assert rows.tree_paths[:4, :4].tolist() == paths.tolist() and rows.row_index[:4].tolist() == depth.tolist()
        assert rows.row_request.tolist() == [0] * 4 + [-1] * 4 and not rows.tree_paths[4:].any()
        assert (rows.kv_lens.tolist(), rows.new_starts.tolist(), rows.block_tables[0, :3].tolist()) == (
            [34],
            [30],
            [3, 1, 2],
        )


def test_a_prefill_keeps_the_usual_split_count_under_invariant_steps():
    """Fixed split-kv ranges are for the padded steps only: a long prefill's step keeps the split count of its grid
    (fixed splits over 4096 rows allocated a 4 GiB workspace on demo@kimi-k2.6)."""
    import torch

    from specserve.models.presets import build_synthetic_model
    from specserve.models.triton_paged_attention import INVARIANT_MAX_ROWS, TritonPagedBackend

    model, _ = build_synthetic_model("synthetic:tiny-qwen3-moe", device="cpu", dtype=torch.float32)
    backend = TritonPagedBackend(model.model.layers[0].self_attn, 16, "cpu", invariant=True, max_window=40960)
    assert backend._new_step(1, 17, 600, 17).shape.split_chunk > 0
    prefill = backend._new_step(1, 4096, 4096, None).shape
    assert INVARIANT_MAX_ROWS < 4096 and prefill.split_chunk == 0 and prefill.num_splits == 1
