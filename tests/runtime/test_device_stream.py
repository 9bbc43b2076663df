"""A model thread's own CUDA stream and the hand-over of tensors to it (specserve/runtime/device_stream.py). On the
GPU (marked gpu, skipped without CUDA): a tensor still being written on the default stream is read, on the thread's
own stream, only once written; and a tensor its maker frees while the stream has yet to read it keeps its memory.
Each with its negative control, the same reads without the hand-over, which see the other values. And a tensor its
maker marked complete (written before a host read) is read without waiting for work queued on the default stream
since (another request's verify); its control, unmarked, waits."""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.runtime.device_stream import enter_own_stream, hand_over, mark_complete

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BUSY_CYCLES = 100_000_000  # torch.cuda._sleep: some 50 ms of one stream's time on any GPU, much longer than a hop
N = 1 << 20  # floats (4 MiB: the allocator's large pool, where a freed block is the next one of its size)


def test_off_cuda_there_is_no_stream_and_a_hand_over_is_the_tensor_itself():
    assert enter_own_stream("cpu") is None and enter_own_stream(None) is None
    rows = torch.ones(3, 4)
    assert hand_over(rows, None) is rows and hand_over(None, None) is None


class _OwnStreamThread:
    """A thread on its own stream (made first, before the test queues anything on the default stream) that runs
    one function when told and hands back its result."""

    def __init__(self) -> None:
        self.ready, self.go, self.out = threading.Event(), threading.Event(), {}
        self.fn = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(60)

    def _run(self) -> None:
        try:
            stream = enter_own_stream("cuda")
            assert stream is not None and torch.cuda.current_stream() == stream != torch.cuda.default_stream()
            self.ready.set()
            self.go.wait(60)
            self.out["value"] = self.fn(stream)
        except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
            self.out["error"] = e
            self.ready.set()

    def run(self, fn):
        self.fn = fn
        self.go.set()
        self.thread.join(60)
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("handed", [True, False], ids=["hand-over", "negative-control"])
def test_a_tensor_handed_over_is_read_after_its_maker_wrote_it(handed):
    rows = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    worker = _OwnStreamThread()
    torch.cuda._sleep(BUSY_CYCLES)  # the default stream is busy, then writes the rows
    rows.fill_(1.0)

    def read(stream):
        seen = (hand_over(rows, stream) if handed else rows).clone()  # on the thread's own stream
        return float(seen.sum())  # reads back on that stream only

    total = worker.run(read)
    torch.cuda.synchronize()
    assert total == (N if handed else 0.0)


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("handed", [True, False], ids=["hand-over", "negative-control"])
def test_a_tensor_freed_by_its_maker_keeps_its_memory_until_the_stream_read_it(handed):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no free block of the default stream but the one freed below
    box = {"rows": torch.full((N,), 3.0, device="cuda")}
    address = box["rows"].data_ptr()
    torch.cuda.synchronize()
    worker = _OwnStreamThread()

    def read(stream):
        rows = box.pop("rows")
        if handed:
            hand_over(rows, stream)
        torch.cuda._sleep(BUSY_CYCLES)  # this stream reads the rows only later
        seen = rows.clone()
        return seen  # and drops the last reference: the rows are freed while this stream has yet to read them

    seen = worker.run(read)
    new = torch.empty(N, device="cuda")  # the maker's next allocation, written at once on the default stream
    new.fill_(7.0)
    torch.cuda.synchronize()
    if handed:
        assert new.data_ptr() != address and bool((seen == 3.0).all())
    else:  # the freed block went to the default stream's next allocation, which wrote it before the read
        assert new.data_ptr() == address and bool((seen == 7.0).all())


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("complete", [True, False], ids=["marked-complete", "negative-control"])
def test_a_tensor_marked_complete_is_read_without_waiting_for_the_default_stream(complete):
    rows = torch.ones(N, device="cuda")
    torch.cuda.synchronize()  # written, and the maker read that back: complete
    if complete:
        mark_complete(rows)
    worker = _OwnStreamThread()
    torch.cuda._sleep(BUSY_CYCLES)  # the default stream is busy with other work (another request's verify)

    def read(stream):
        seen = hand_over(rows, stream).sum()
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()  # this stream's read: at once when it waited for nothing
        return float(seen), torch.cuda.default_stream().query()  # was the default stream still busy?

    total, default_idle = worker.run(read)
    torch.cuda.synchronize()
    assert total == N and default_idle == (not complete)
