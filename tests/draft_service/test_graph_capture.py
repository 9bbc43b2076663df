"""capture_or_record: a shape that cannot be captured is recorded with its reason and warned about, never raised;
capture_all_or_warn: a drafter whose graphs fail to capture gets None and a warning (it then drafts eagerly)."""

from __future__ import annotations

import pytest
import torch

from specserve.draft_service.graph_capture import capture_all_or_warn, capture_or_record


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path: no CUDA graphs without a GPU")
def test_a_shape_that_cannot_be_captured_is_recorded_not_raised():
    graphs, errors, ran = {}, {}, []
    with pytest.warns(RuntimeWarning, match=r"Owner: graph \(1, 'greedy'\) not captured, runs eager"):
        capture_or_record("Owner", (1, "greedy"), lambda: ran.append(1), None, graphs, errors)
    assert graphs == {} and list(errors) == [(1, "greedy")] and errors[(1, "greedy")]


class _Graphs:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def capture(self) -> None:
        if self.error is not None:
            raise self.error


def test_graphs_that_fail_to_capture_give_none_and_a_warning():
    fine = _Graphs(None)
    assert capture_all_or_warn(fine, "x chains") is fine
    with pytest.warns(RuntimeWarning, match=r"x chains: CUDA graphs not captured, run eager: RuntimeError: no room"):
        assert capture_all_or_warn(_Graphs(RuntimeError("no room")), "x chains") is None
