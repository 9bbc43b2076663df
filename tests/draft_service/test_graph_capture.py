"""capture_or_record: a shape that cannot be captured is recorded with its reason and warned about, never raised."""

from __future__ import annotations

import pytest
import torch

from specserve.draft_service.graph_capture import capture_or_record


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path: no CUDA graphs without a GPU")
def test_a_shape_that_cannot_be_captured_is_recorded_not_raised():
    graphs, errors, ran = {}, {}, []
    with pytest.warns(RuntimeWarning, match=r"Owner: graph \(1, 'greedy'\) not captured, runs eager"):
        capture_or_record("Owner", (1, "greedy"), lambda: ran.append(1), None, graphs, errors)
    assert graphs == {} and list(errors) == [(1, "greedy")] and errors[(1, "greedy")]
