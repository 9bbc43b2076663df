"""Counting a drafter's device work on the CPU: the aten ops that would each launch a kernel on a GPU, and the reads
that would each make the host wait for the device (a propose's host syncs).

`DeviceWork` is a TorchDispatchMode: an op counts as a kernel when it writes memory (an in-place or out= op, or one
whose output does not share its storage with an input: views, reshapes that only view and no-op dtype casts count
nothing; empty* allocates and counts nothing); `aten._local_scalar_dense` (``.item()``, ``bool()``, ``int()`` of a
tensor) is a host read. ``.tolist()`` and ``.cpu()`` do not dispatch on a CPU tensor, so the mode wraps them while it is on
(on a GPU each is a device-to-host copy the host waits for); ``.numpy()`` is not one (a GPU tensor has none: it reads
host memory only), nor is ``.to(device)`` (a drafter moves rows to its own device with it; the CPU cannot tell that
from a read). On the CPU a norm counts its
pure-torch ops (the Triton norm is one launch on a GPU), so the counts are a GPU's with each norm's ops in place of
its one kernel.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = ("tolist", "cpu")
_NO_KERNEL = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty")


def _storages(tree) -> set[int]:
    found = set()
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


class DeviceWork(TorchDispatchMode):
    """with DeviceWork() as w: ... -> w.kernels, w.host_reads, w.ops (kernel ops by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_reads = 0
        self._saved: dict = {}

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if name == "aten._local_scalar_dense":
            self.host_reads += 1
        elif func._schema.is_mutable:
            self.ops[name] += 1
        elif name not in _NO_KERNEL and (_storages(out) - _storages((args, kwargs))):
            self.ops[name] += 1
        return out

    def __enter__(self):
        for name in _HOST_READS:
            method = self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved.clear()
        return super().__exit__(*exc)

    def _counting(self, method):
        def read(tensor, *args, **kwargs):
            self.host_reads += 1
            return method(tensor, *args, **kwargs)

        return read
