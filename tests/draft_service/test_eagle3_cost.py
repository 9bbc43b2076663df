"""What one EAGLE-3 propose costs the device, counted on the CPU (tests/draft_service/device_work.py): the kernels a
drafted token launches and the host reads (each a host sync on a GPU) a propose makes, pinned, so that a change
that adds either fails here.

The proposes run through the CUDA graphs' bodies (eagle3_graph.py: on a CPU they run eagerly over the same buffers,
the ops a GPU records), in the steady state of a speculation: each propose feeds the two confirmed tokens of the last
verify (catch-up) and drafts k. Before the window pass (eagle3_head.py window_step: q/k/v and gate/up as one GEMM each,
RoPE from a table in three kernels, attention over the window under an additive bias with no copy of it, the down
projection adding the residual, greedy ids without the float logits) a drafted token cost 68.3 ops here and a k = 1
propose 88; a propose read the device twice (greedy: its rows' finiteness, then the tokens) or four times (sampled:
also q and d2t). On a GPU each norm is one Triton launch instead of its six ops here: 46 - 4 * 5 = 26 kernels a drafted
token (the H200 profile counted 63.5 before, `specserve bench draft`).
"""

from __future__ import annotations

import pytest
from device_work import DeviceWork
from draft_helpers import FakeFeatures
from eagle3_helpers import TARGET_H, VOCAB, save_tiny_eagle3

from specserve.contract.types import SamplingParams
from specserve.draft_service.drafter_config import DrafterConfig
from specserve.draft_service.registry import build_proposer

KERNELS_PER_DRAFTED_TOKEN = 46  # the window pass (was 68.3)
KERNELS_PER_K1_PROPOSE = 59  # a catch-up of 2 tokens and one drafted token (was 88)
HOST_READS_PER_PROPOSE = 1  # the drafted block (greedy: with its rows' check; sampled: with q), was 2 / 4


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    _, hdir, tdir = save_tiny_eagle3(tmp_path_factory.mktemp("eagle3_cost"))
    return DrafterConfig(family="eagle3", checkpoint=hdir, target_checkpoint=tdir, max_block_size=4)


def _steady_proposes(config, k: int, sampled: bool, steps: int = 3) -> list[DeviceWork]:
    feats = FakeFeatures(VOCAB, 3 * TARGET_H)
    proposer = build_proposer(config)
    proposer.chain_graphs = proposer.build_chain_graphs(64, config.max_block_size)
    seq = list(range(1, 12))
    sampling = SamplingParams(temperature=0.8, seed=1) if sampled else SamplingParams()
    proposer.start("s", seq, feats.rows(seq, 0, len(seq) - 1), sampling)
    proposer.propose("s", len(seq), [], None, k)  # the prompt's catch-up
    counted = []
    for step in range(steps):
        new = [5 + step, 7 + step]  # one accepted token and the next
        rows = feats.rows(seq + new, len(seq) - 1, len(seq) + 1)
        with DeviceWork() as work:
            assert len(proposer.propose("s", len(seq), new, rows, k)) == k
        counted.append(work)
        seq += new
    return counted


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_propose_reads_the_device_once(config, sampled):
    for k in (1, 4):
        reads = [w.host_reads for w in _steady_proposes(config, k, sampled)]
        assert reads == [HOST_READS_PER_PROPOSE] * len(reads), f"k={k}: {reads}"


def test_kernels_per_drafted_token_are_pinned(config):
    """Greedy: a drafted token's kernels (k = 4 against k = 1, per extra token) and a k = 1 propose's."""
    k1, k4 = (_steady_proposes(config, k, sampled=False)[-1] for k in (1, 4))
    per_token = (k4.kernels - k1.kernels) / 3
    assert per_token <= KERNELS_PER_DRAFTED_TOKEN, (per_token, (k4.ops - k1.ops).most_common())
    assert k1.kernels <= KERNELS_PER_K1_PROPOSE, k1.ops.most_common()
