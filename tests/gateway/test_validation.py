"""validate_request on hostile values (issue #19): bounded tree parameters, unknown enum values."""

from __future__ import annotations

import pytest

from specserve.contract.types import TreeSpec
from specserve.gateway.validation import MAX_TREE_TOP_K, InvalidRequest, validate_request
from specserve.protos.specserve.v1 import gateway_pb2, target_pb2

TARGET = target_pb2.TargetInfo(vocab_size=256, max_context=512)


def check(**fields):
    return validate_request(
        gateway_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=4, **fields), TARGET, {"model"}, "model"
    )


@pytest.mark.parametrize(
    "fields,field",
    [
        (dict(tree_nodes=64, tree_top_k=1_000_000, tree_depth=2), "tree_top_k"),
        (dict(tree_nodes=8, tree_top_k=2, tree_depth=10_000), "tree_depth"),
        (dict(tree_nodes=65), "tree_nodes"),
        (dict(speculation=99), "speculation"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(fields, field):
    with pytest.raises(InvalidRequest) as info:
        check(**fields)
    assert info.value.field == field and len(str(info.value)) < 200


def test_bounds_themselves_are_accepted():
    assert check(tree_nodes=64, tree_top_k=MAX_TREE_TOP_K, tree_depth=4).tree == TreeSpec(64, MAX_TREE_TOP_K, 4)
    assert check(speculation=gateway_pb2.SPECULATION_ADAPTIVE).adaptive
    assert check(stop=["\n", "x" * 256]).stop == ("\n", "x" * 256)  # ids and stop strings, no text prompt
