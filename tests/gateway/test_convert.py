"""protos/convert.py: engine types <-> specserve.v1 messages, and validation of what arrives."""

import math

import pytest
import torch

from specserve.contract.types import DraftBlock, SamplingParams, StepTimings
from specserve.protos import convert
from specserve.protos.specserve.v1 import common_pb2


def test_tensor_roundtrip_any_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 5).to(dtype)
        back = convert.tensor_from_proto(convert.tensor_to_proto(t))
        assert back.dtype == torch.float32 and back.shape == (3, 5)
        assert torch.equal(back, t.float())


def test_tensor_bad_length_names_field():
    msg = common_pb2.Tensor(shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(convert.ConversionError, match="hidden: 20 bytes"):
        convert.tensor_from_proto(msg, "hidden")


def test_sampling_roundtrip_and_unset_top_p():
    s = SamplingParams(temperature=0.5, top_p=0.75, top_k=5, seed=11)
    assert convert.sampling_from_proto(convert.sampling_to_proto(s)) == s
    assert convert.sampling_from_proto(common_pb2.SamplingParams()).top_p == 1.0
    assert convert.sampling_from_proto(common_pb2.SamplingParams()).seed is None
    with pytest.raises(convert.ConversionError, match="sampling.temperature: must be a finite number"):
        convert.sampling_from_proto(common_pb2.SamplingParams(temperature=-1))


def test_draft_block_chain_tree_probs():
    chain = DraftBlock(token_ids=(1, 2, 3))
    assert convert.draft_block_from_proto(convert.draft_block_to_proto(chain)) == chain
    probs = torch.softmax(torch.randn(3, 10), -1)
    tree = DraftBlock(token_ids=(4, 5, 6), parents=(-1, 0, 0), probs=probs)
    back = convert.draft_block_from_proto(convert.draft_block_to_proto(tree), vocab_size=10)
    assert back.token_ids == tree.token_ids and back.parents == tree.parents
    assert torch.equal(back.probs, probs)


@pytest.mark.parametrize(
    "ids,probs,match",
    [
        ((1, 99), None, "outside the vocabulary"),
        ((1, 2), torch.full((2, 10), math.nan), "NaN"),
        ((1, 2), torch.ones(3, 10), "shape"),
        ((1, 2), -torch.ones(2, 10), "negative"),
    ],
)
def test_draft_block_garbage_rejected(ids, probs, match):
    msg = convert.draft_block_to_proto(DraftBlock(token_ids=ids))
    if probs is not None:
        msg.probs.CopyFrom(convert.tensor_to_proto(probs))
        msg.has_probs = True
    with pytest.raises(convert.ConversionError, match=match):
        convert.draft_block_from_proto(msg, vocab_size=10)


def test_draft_block_confidence_round_trip_and_garbage():
    """A chain's per-token confidence (DSpark's head) crosses the wire as it is; one of the wrong length, outside
    [0, 1], NaN or on a tree is refused, naming the field."""
    block = DraftBlock(token_ids=(1, 2, 3), confidence=(0.75, 0.5, 0.125))
    assert convert.draft_block_from_proto(convert.draft_block_to_proto(block), vocab_size=10) == block
    for ids, conf, tree in (
        ((1, 2), (0.5,), False),
        ((1, 2), (0.5, 1.5), False),
        ((1, 2), (0.5, math.nan), False),
        ((1, 2), (0.5, 0.5), True),
    ):
        msg = common_pb2.DraftBlock(token_ids=ids, confidence=conf, is_tree=tree, parents=[-1, 0] if tree else [])
        with pytest.raises(convert.ConversionError, match="draft: confidence"):
            convert.draft_block_from_proto(msg, vocab_size=10)


def test_bad_tree_parents_rejected():
    msg = common_pb2.DraftBlock(token_ids=[1, 2], parents=[-1, 5], is_tree=True)
    with pytest.raises(convert.ConversionError, match="parents"):
        convert.draft_block_from_proto(msg)


def test_timings():
    t = StepTimings(queue_ms=1.0, forward_ms=2.0, sample_ms=3.0)
    msg = convert.timings_to_proto(t, total_ms=7.0, queue_ms=0.5)
    assert (msg.queue_ms, msg.forward_ms, msg.sample_ms, msg.total_ms) == (0.5, 2.0, 3.0, 7.0)
    assert convert.timings_from_proto(convert.timings_to_proto(t)) == t
    assert convert.timings_from_proto(msg).total_ms == 7.0
