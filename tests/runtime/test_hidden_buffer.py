"""specserve/runtime/hidden_share.py on the CPU (host_shm): a target's buffer, a drafter's mapping of it
through its handle (as it crosses the wire), bad handles and rows, and that no name outlives its use,
also when the process that made the buffer is SIGKILLed. join_hidden (the gateway's merge of steps' rows)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
import torch

from specserve.contract.types import SharedRows, join_hidden
from specserve.runtime.hidden_fds import FdServer
from specserve.runtime.hidden_share import (
    CUDA_IPC,
    HOST_SHM,
    HiddenBuffer,
    HiddenHandle,
    HiddenShareError,
    HiddenView,
    hidden_share_allowed,
    host_id,
    kind_for,
)
from specserve.runtime.shm_layout import SHM_DIR, leftover_names

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm on this host")


def _name(handle: HiddenHandle) -> str:
    return handle.handle.decode().partition(":")[0]


@pytest.fixture
def server():
    """What offers this test's host_shm segments (the target service's EngineWorker owns one)."""
    srv = FdServer()
    yield srv
    srv.close()


@pytest.fixture
def no_leftovers(monkeypatch):
    """Every segment a buffer of this test made is gone from /dev/shm at its end (names only of this
    test's buffers: other processes of the host may hold specserve names meanwhile)."""
    made: list[str] = []
    create = HiddenBuffer.create.__func__

    def recording(cls, *args, **kw):
        buf = create(cls, *args, **kw)
        made.append(_name(buf.handle))
        return buf

    monkeypatch.setattr(HiddenBuffer, "create", classmethod(recording))
    yield made
    assert [n for n in made if n in leftover_names()] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafter_maps_the_targets_buffer_and_reads_its_rows_in_place(dtype, no_leftovers, server):
    buf = HiddenBuffer.create(16, 6, dtype, "cpu", server)
    assert buf.handle.kind == HOST_SHM == kind_for("cpu") and kind_for("cuda:0") == CUDA_IPC and kind_for("meta") == ""
    name = _name(buf.handle)
    assert (SHM_DIR / name).exists() and oct((SHM_DIR / name).stat().st_mode & 0o777) == "0o600"
    rows = torch.randn(5, 6).to(dtype)
    buf.tensor[2:7].copy_(rows)
    view = HiddenView.open(HiddenHandle.from_proto(buf.handle.to_proto()))  # as it comes over the wire
    assert not (SHM_DIR / name).exists()  # handed over: the offer and its name went at once
    got = view.read(2, 7)
    assert got.dtype == torch.float32 and torch.equal(got, rows.float())  # what the bytes path gives
    buf.tensor[7].fill_(3.0)  # a later step's row: the mapping sees the target's writes
    assert torch.equal(view.read(7, 8), torch.full((1, 6), 3.0))
    got.zero_()  # a private copy: the drafter cannot write into the target's rows through it
    assert torch.equal(buf.tensor[2:7], rows)
    buf.close()  # the target's session ends first: the drafter's mapping stays valid until it closes it
    buf.close()  # twice is harmless
    assert torch.equal(view.read(2, 7), rows.float())
    view.close()


def test_the_target_unlinks_a_name_nobody_mapped(no_leftovers, server):
    buf = HiddenBuffer.create(4, 4, torch.float32, "cpu", server)
    buf.withdraw()
    with pytest.raises(HiddenShareError, match="cannot open segment"):
        HiddenView.open(buf.handle)
    buf.close()


def test_bad_handles_and_rows_are_one_clear_error(no_leftovers, server):
    buf = HiddenBuffer.create(8, 4, torch.float32, "cpu", server)
    h = buf.handle
    with pytest.raises(HiddenShareError, match="kind"):
        HiddenHandle("tcp", 8, 4, "float32", h.handle)
    with pytest.raises(HiddenShareError, match="shape"):
        HiddenHandle(HOST_SHM, 0, 4, "float32", h.handle)
    with pytest.raises(HiddenShareError, match="dtype"):
        HiddenHandle(HOST_SHM, 8, 4, "int8", h.handle)
    with pytest.raises(HiddenShareError, match="handle"):
        HiddenHandle(HOST_SHM, 8, 4, "float32", b"")
    with pytest.raises(HiddenShareError, match="not a specserve segment"):
        HiddenView.open(HiddenHandle(HOST_SHM, 8, 4, "float32", b"../etc/passwd"))
    with pytest.raises(HiddenShareError, match="needs"):  # a handle promising more than the segment holds
        HiddenView.open(HiddenHandle(HOST_SHM, 800, 4, "float32", h.handle))
    assert (SHM_DIR / _name(h)).exists()  # a refused hand-over leaves the offer to the target
    view = HiddenView.open(h)
    for start, stop in ((0, 9), (5, 4), (-1, 2)):
        with pytest.raises(HiddenShareError, match="outside the shared buffer"):
            view.read(start, stop)
    view.close()
    with pytest.raises(HiddenShareError, match="closed"):
        view.read(0, 1)
    buf.close()


def test_a_name_without_its_key_maps_nothing_and_unlinks_nothing(no_leftovers, server):
    """#33: /dev/shm is world-listable, so a segment's name is no secret. A handle naming a session's
    buffer with no key, a wrong key, or a ring segment's name is refused; the segment stays where it
    was, and the handle the target gave (with its key) still maps it."""
    from specserve.runtime.hidden_share import HiddenShareDenied
    from specserve.runtime.shm_ring import ShmChannel

    buf = HiddenBuffer.create(8, 4, torch.float32, "cpu", server)
    name = _name(buf.handle)
    with pytest.raises(HiddenShareError, match="no 32-byte key"):
        HiddenView.open(HiddenHandle(HOST_SHM, 8, 4, "float32", name.encode()))
    with pytest.raises(HiddenShareDenied, match="not the buffer this handle's key opens"):
        HiddenView.open(HiddenHandle(HOST_SHM, 8, 4, "float32", f"{name}:{'00' * 32}".encode()))
    ring = ShmChannel.create()
    try:
        got = []

        def intruder_then_attacher() -> None:  # while the ring's creator waits for its attacher
            with pytest.raises(HiddenShareDenied):
                HiddenView.open(HiddenHandle(HOST_SHM, 8, 4, "float32", f"{ring.name}:{'00' * 32}".encode()))
            assert (SHM_DIR / ring.name).exists()
            got.append(ShmChannel.attach(ring.ticket))

        t = threading.Thread(target=intruder_then_attacher)
        t.start()
        ring.accept(timeout=10)  # the ring is still its own
        t.join(10)
        got[0].close()
    finally:
        ring.close()
    assert (SHM_DIR / name).exists()
    HiddenView.open(buf.handle).close()
    buf.close()


def test_flags_and_host_identity():
    assert hidden_share_allowed(False, {}) and not hidden_share_allowed(True, {})
    assert not hidden_share_allowed(False, {"SPECSERVE_HIDDEN_SHARE": "0"})
    assert host_id() and host_id() == host_id()


_MAKER = """
import sys, time, torch
from specserve.runtime.hidden_fds import FdServer
from specserve.runtime.hidden_share import HiddenBuffer
buf = HiddenBuffer.create(8, 4, torch.float32, "cpu", FdServer())
buf.tensor[:].fill_(7.0)
print(buf.handle.handle.decode(), flush=True)
time.sleep(600)
"""


def test_a_target_killed_after_the_drafter_mapped_leaves_nothing_and_the_rows_stay_readable(no_leftovers):
    proc = subprocess.Popen([sys.executable, "-c", _MAKER], stdout=subprocess.PIPE, text=True)
    try:
        handle = proc.stdout.readline().strip()
        no_leftovers.append(handle.partition(":")[0])
        view = HiddenView.open(HiddenHandle(HOST_SHM, 8, 4, "float32", handle.encode()))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert torch.equal(view.read(0, 8), torch.full((8, 4), 7.0))
        view.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_join_hidden_merges_ranges_and_keeps_bytes_after_them_as_a_tail():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert torch.equal(join_hidden([a, b]), torch.cat([a, b]))
    assert join_hidden([SharedRows(0, 5, handle="h"), SharedRows(5, 7)]) == SharedRows(0, 7, handle="h")
    joined = join_hidden([SharedRows(3, 5), SharedRows(5, 6), a, b])
    assert (joined.start, joined.stop, joined.num_rows) == (3, 6, 6) and torch.equal(joined.tail, torch.cat([a, b]))
    with pytest.raises(ValueError, match="does not follow"):
        join_hidden([SharedRows(0, 5), SharedRows(6, 7)])
    with pytest.raises(ValueError, match="after rows sent as bytes"):
        join_hidden([a, SharedRows(0, 1)])
    with pytest.raises(ValueError, match="row range"):
        SharedRows(4, 3)


def _cuda_maker(to_parent, from_parent) -> None:
    """Another process: a cuda buffer, its handle as wire bytes, then an in-place write the mapping must see."""
    from specserve.runtime.hidden_share import HiddenBuffer as Buffer

    buf = Buffer.create(8, 4, torch.bfloat16, "cuda")
    buf.tensor.copy_(torch.arange(32, dtype=torch.bfloat16, device="cuda").view(8, 4))
    torch.cuda.synchronize()
    to_parent.put(buf.handle.to_proto().SerializeToString())
    assert from_parent.get(timeout=300) == "read"
    buf.tensor[3].fill_(-1.0)
    torch.cuda.synchronize()
    to_parent.put("written")
    assert from_parent.get(timeout=300) == "bye"
    buf.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_buffer_of_another_process_is_read_in_place():
    from specserve.protos.specserve.v1 import common_pb2

    ctx = torch.multiprocessing.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    maker = ctx.Process(target=_cuda_maker, args=(to_parent, from_parent))
    maker.start()
    try:
        msg = common_pb2.HiddenShare()
        msg.ParseFromString(to_parent.get(timeout=300))
        handle = HiddenHandle.from_proto(msg)
        assert handle.kind == CUDA_IPC and (handle.rows, handle.cols, handle.dtype) == (8, 4, "bfloat16")
        view = HiddenView.open(handle)
        want = torch.arange(32, dtype=torch.float32).view(8, 4)
        got = view.read(0, 8)
        assert got.is_cuda and got.dtype == torch.float32 and torch.equal(got.cpu(), want)
        from_parent.put("read")
        assert to_parent.get(timeout=300) == "written"
        want[3] = -1.0
        assert torch.equal(view.read(0, 8).cpu(), want)  # the other process's memory, not a copy
        with pytest.raises(HiddenShareError, match="outside"):
            view.read(0, 9)
        view.close()
        from_parent.put("bye")
        maker.join(120)
        assert maker.exitcode == 0
    finally:
        if maker.is_alive():
            maker.kill()
            maker.join()


_CLOSE_UNDER_A_VIEW = """
import torch
from specserve.runtime.hidden_fds import FdServer
from specserve.runtime.hidden_share import HiddenBuffer
server = FdServer()
buf = HiddenBuffer.create(64, 64, torch.float32, "cpu", server)
held = buf.tensor[8:16]
buf.close()
held.add_(1.0)  # the mapping is pinned while a tensor over it lives: no use after unmap
assert float(held.sum()) == 8 * 64
server.close()
"""


def test_closing_a_buffer_under_a_live_tensor_never_unmaps_it():
    """(torch.frombuffer over the segment segfaulted here: close unmapped memory a tensor still used.)"""
    done = subprocess.run([sys.executable, "-c", _CLOSE_UNDER_A_VIEW], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
