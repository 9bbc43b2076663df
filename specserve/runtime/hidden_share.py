"""A session's target hidden rows shared on one host: the target writes each step's committed rows into
a per-session buffer, the drafter maps the buffer once and reads the rows there; the gateway relays only
the buffer's handle (once per session) and which rows are new (a row range per step).

Two kinds behind one interface, picked from the target tensor's device:

- ``host_shm``: a ``multiprocessing.shared_memory`` segment in /dev/shm holding the [rows, cols] tensor
  (CPU targets; what CI tests). /dev/shm is world-listable, so the name is no secret: the segment
  starts with a header (a magic and a 256-bit random key of the session), the handle carries the
  name and the key, and the drafter maps a segment only when its header holds that magic and key
  (compared in constant time); otherwise it refuses (PERMISSION_DENIED) and leaves the segment, name
  included, alone, so whoever lists /dev/shm cannot have a session's rows mapped, unlink its buffer
  or pass a ring segment off as one. Names and leaks as in shm_layout.py: the segment is created mode 0600 and
  named ``specserve-<96-bit random token>``; the drafter unlinks the name as soon as it has mapped it,
  and the target unlinks it at the session's first verify step (by then the drafter has attached or
  never will) or at its end, so while the session runs nothing is left by name and a SIGKILL of
  either side leaves nothing. Only a target killed between its Prefill reply and the drafter's attach
  leaves the name (the same window as a ring's offer).
- ``cuda_ipc``: a CUDA tensor's IPC handle, made and opened with torch.multiprocessing's reductions
  (``reduce_tensor`` / ``rebuild_cuda_tensor``). The handle's fields travel as JSON, never a pickle,
  so a handle from the wire cannot run code. Torch's IPC reference counter keeps the allocation alive
  while the drafter maps it, even after the target's session ends.

Row i of a buffer is the hidden row of position i of the session's sequence S. The target writes only
committed rows, and a committed position is never written again, so a range the drafter was told about
does not change under it. The drafter only reads (and copies the rows out), and the target never reads
the buffer back: nothing a drafter does can change the target's output.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

from specserve.protos.specserve.v1 import common_pb2
from specserve.runtime.shm_layout import NAME_PREFIX, SHM_DIR

HIDDEN_SHARE_ENV = "SPECSERVE_HIDDEN_SHARE"  # "0": hidden rows always as bytes (flag: --no-hidden-share)
HOST_SHM, CUDA_IPC = "host_shm", "cuda_ipc"
KINDS = (HOST_SHM, CUDA_IPC)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HANDLE_BYTES = 4096
_MAGIC = b"specserve-hidden-rows-v1"  # a host_shm segment's header: the magic, then the session's key
_KEY_BYTES = 32
_HEADER = 64  # bytes before row 0 (a cache line; the rows stay 64-byte aligned)
_SEGMENT_NAME = re.compile(re.escape(NAME_PREFIX) + "[0-9a-f]{24}")


class HiddenShareError(ValueError):
    """A handle that cannot be made or mapped here, or rows outside the buffer (one line saying which)."""


class HiddenShareDenied(HiddenShareError):
    """A host_shm handle whose key is not the one in the segment it names (not this caller's buffer)."""


def hidden_share_allowed(no_flag: bool, environ) -> bool:
    """On unless --no-hidden-share or SPECSERVE_HIDDEN_SHARE=0 says otherwise."""
    return not no_flag and environ.get(HIDDEN_SHARE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def host_id() -> str:
    """Who can map this process's buffers: the kernel's boot id and the identity of /dev/shm (a container
    with its own /dev/shm differs; one with the host's, e.g. ``ipc: host``, does not). "" when unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def kind_for(device: torch.device | str) -> str:
    """The kind of a buffer on this device ("" where there is none: rows go as bytes)."""
    return {"cuda": CUDA_IPC, "cpu": HOST_SHM}.get(torch.device(device).type, "")


def mappable_kinds() -> tuple[str, ...]:
    """The kinds this process can map (host_shm always; cuda_ipc where CUDA is)."""
    if not SHM_DIR.is_dir():
        return (CUDA_IPC,) if torch.cuda.is_available() else ()
    return KINDS if torch.cuda.is_available() else (HOST_SHM,)


@dataclass(frozen=True)
class HiddenHandle:
    """What the drafter needs to map a buffer: its kind, shape and dtype, and the kind's opaque handle."""

    kind: str
    rows: int
    cols: int
    dtype: str  # a key of DTYPES
    handle: bytes  # host_shm: the segment's name, ":", its key in hex; cuda_ipc: the IPC handle's fields (JSON)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise HiddenShareError(f"hidden_share.kind: {self.kind[:40]!r} is not one of {list(KINDS)}")
        if self.rows < 1 or self.cols < 1:
            raise HiddenShareError(f"hidden_share.shape: [{self.rows}, {self.cols}] is not a [rows >= 1, cols >= 1] buffer")
        if self.dtype not in DTYPES:
            raise HiddenShareError(f"hidden_share.dtype: {self.dtype[:40]!r} is not one of {sorted(DTYPES)}")
        if not 0 < len(self.handle) <= MAX_HANDLE_BYTES:
            raise HiddenShareError(f"hidden_share.handle: {len(self.handle)} bytes (expected 1..{MAX_HANDLE_BYTES})")

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * DTYPES[self.dtype].itemsize

    def to_proto(self) -> common_pb2.HiddenShare:
        return common_pb2.HiddenShare(kind=self.kind, shape=[self.rows, self.cols], dtype=self.dtype, handle=self.handle)

    @classmethod
    def from_proto(cls, msg: common_pb2.HiddenShare) -> HiddenHandle:
        if len(msg.shape) != 2:
            raise HiddenShareError(f"hidden_share.shape: {list(msg.shape)[:4]} is not [rows, cols]")
        return cls(msg.kind, int(msg.shape[0]), int(msg.shape[1]), msg.dtype, bytes(msg.handle))


# ------------------------------------------------------------------------------------------ the target's end
class HiddenBuffer:
    """The target's buffer of one session: ``tensor`` [rows, cols] in the engine's dtype on its device,
    and the ``handle`` to hand over once. ``unlink`` removes a host_shm name (idempotent); ``close``
    frees the buffer (the drafter's mapping, if any, stays valid until it closes its own)."""

    def __init__(self, tensor: torch.Tensor, handle: HiddenHandle, shm: SharedMemory | None) -> None:
        self.tensor = tensor  # [rows, cols]
        self.handle = handle
        self._shm = shm
        self._linked = shm is not None

    @property
    def rows(self) -> int:
        return self.handle.rows

    @classmethod
    def create(cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str) -> HiddenBuffer:
        """Raises HiddenShareError (a dtype with no name here, no room in /dev/shm, no device memory)."""
        if dtype not in _DTYPE_NAMES:
            raise HiddenShareError(f"no hidden share for dtype {dtype}")
        name_of_dtype = _DTYPE_NAMES[dtype]
        device = torch.device(device)
        if not kind_for(device):
            raise HiddenShareError(f"no hidden share on a {device.type} device")
        if kind_for(device) == CUDA_IPC:
            try:
                tensor = torch.zeros(rows, cols, dtype=dtype, device=device)
            except RuntimeError as exc:  # out of device memory: this session's rows go as bytes
                raise HiddenShareError(f"no device buffer of [{rows}, {cols}]: {str(exc)[:200]}") from None
            return cls(tensor, HiddenHandle(CUDA_IPC, rows, cols, name_of_dtype, _cuda_handle(tensor)), None)
        name = NAME_PREFIX + secrets.token_hex(12)
        key = secrets.token_bytes(_KEY_BYTES)
        nbytes = rows * cols * dtype.itemsize
        try:
            shm = _create_segment(name, _HEADER + nbytes)
        except OSError as exc:
            raise HiddenShareError(f"no /dev/shm segment of {nbytes} bytes: {exc}") from None
        shm.buf[: len(_MAGIC) + _KEY_BYTES] = _MAGIC + key
        handle = HiddenHandle(HOST_SHM, rows, cols, name_of_dtype, f"{name}:{key.hex()}".encode())
        return cls(_segment_tensor(shm, rows, cols, dtype), handle, shm)

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / _shm_name_and_key(self.handle)[0]).unlink()

    def close(self) -> None:
        self.unlink()
        on_cuda = self.tensor is not None and self.tensor.is_cuda
        self.tensor = None
        if on_cuda:  # memory a drafter still mapped waits in torch's IPC limbo: free what it has let go
            torch.cuda.ipc_collect()
        if self._shm is not None:
            shm, self._shm = self._shm, None
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                shm.close()


def _segment_tensor(shm: SharedMemory, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:  # [rows, cols]
    """A tensor over the segment's rows (after its header) that pins its mapping: numpy holds a buffer
    export of it, so the segment cannot be unmapped (close raises BufferError) while any tensor over it
    lives (torch.frombuffer would not pin it: a close under a live tensor is a use after unmap)."""
    raw = np.frombuffer(shm.buf, dtype=np.uint8, count=rows * cols * dtype.itemsize, offset=_HEADER)
    return torch.from_numpy(raw).view(dtype).view(rows, cols)


def _shm_name_and_key(handle: HiddenHandle) -> tuple[str, bytes]:
    """A host_shm handle's segment name and key (HiddenShareError when it is not one)."""
    name, sep, key_hex = handle.handle.decode("utf-8", "replace").partition(":")
    if not _SEGMENT_NAME.fullmatch(name):  # what create makes: never a ring's FIFO, never a path
        raise HiddenShareError(f"hidden_share: {name[:70]!r} is not a specserve segment name")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        key = b""
    if not sep or len(key) != _KEY_BYTES:
        raise HiddenShareError(f"hidden_share: the handle of {name} carries no {_KEY_BYTES}-byte key")
    return name, key


def _create_segment(name: str, nbytes: int) -> SharedMemory:
    """A 0600 segment whose pages are allocated now (a full /dev/shm is an OSError here, never a SIGBUS)."""
    shm = SharedMemory(name=name, create=True, size=nbytes)
    resource_tracker.unregister(shm._name, "shared_memory")  # the name lives as long as the session, not the process
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except BaseException:
        shm.close()
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
        raise
    return shm


def _cuda_handle(tensor: torch.Tensor) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    fields = dict(size=list(size), stride=list(stride), offset=int(offset), device=int(device),
                  handle=bytes(handle).hex(), storage_bytes=int(storage_bytes), storage_offset=int(storage_offset),
                  ref_handle=bytes(ref_handle).hex(), ref_offset=int(ref_offset),
                  event_handle=bytes(event_handle or b"").hex(), event_sync=bool(event_sync))
    return json.dumps(fields, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------------------- the drafter's end
class HiddenView:
    """The drafter's mapping of one session's buffer. ``read(start, stop)`` copies rows out as float32 on
    the buffer's device (the values the byte path gives, so a drafter drafts exactly the same block)."""

    def __init__(self, tensor: torch.Tensor, handle: HiddenHandle, shm: SharedMemory | None) -> None:
        self.tensor = tensor  # [rows, cols], the target's memory
        self.handle = handle
        self._shm = shm

    @classmethod
    def open(cls, handle: HiddenHandle) -> HiddenView:
        """Map the buffer (host_shm: and unlink its name at once). Raises HiddenShareError."""
        if handle.kind == HOST_SHM:
            return cls._open_shm(handle)
        if not torch.cuda.is_available():
            raise HiddenShareError("hidden_share: a cuda_ipc buffer, but this process has no CUDA")
        try:
            tensor = _open_cuda(handle)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise HiddenShareError(f"hidden_share: cannot open the cuda_ipc handle: {str(exc)[:200]}") from None
        if tuple(tensor.shape) != (handle.rows, handle.cols) or tensor.dtype != DTYPES[handle.dtype]:
            raise HiddenShareError(f"hidden_share: the cuda_ipc buffer is {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"the handle says [{handle.rows}, {handle.cols}] {handle.dtype}")
        return cls(tensor, handle, None)

    @classmethod
    def _open_shm(cls, handle: HiddenHandle) -> HiddenView:
        """Map the segment only if its header holds the handle's key; whatever is refused is left as it
        was (never unlinked: it may be another session's buffer, or a ring)."""
        name, key = _shm_name_and_key(handle)
        try:
            shm = SharedMemory(name=name, create=False)
        except OSError as exc:
            raise HiddenShareError(f"hidden_share: cannot open segment {name}: {exc.strerror or exc}") from None
        resource_tracker.unregister(shm._name, "shared_memory")  # the target's, not ours to unlink at exit
        header = bytes(shm.buf[: len(_MAGIC) + _KEY_BYTES]) if shm.size >= _HEADER else b""
        if not hmac.compare_digest(header, _MAGIC + key):
            shm.close()
            raise HiddenShareDenied(f"hidden_share: segment {name} is not the buffer this handle's key opens")
        if shm.size < _HEADER + handle.nbytes:  # not what the handle says: left to the target (it unlinks it)
            shm.close()
            raise HiddenShareError(f"hidden_share: segment {name} has {shm.size - _HEADER} bytes of rows, the "
                                   f"handle's [{handle.rows}, {handle.cols}] {handle.dtype} needs {handle.nbytes}")
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()  # mapped, and ours: nothing needs the name any more
        return cls(_segment_tensor(shm, handle.rows, handle.cols, DTYPES[handle.dtype]), handle, shm)

    def read(self, start: int, stop: int) -> torch.Tensor:  # [stop - start, cols] float32, a private copy
        if self.tensor is None:
            raise HiddenShareError("hidden rows: the shared buffer is closed")
        if not 0 <= start <= stop <= self.handle.rows:
            raise HiddenShareError(f"hidden rows [{start}, {stop}) outside the shared buffer's {self.handle.rows} rows")
        return self.tensor[start:stop].to(dtype=torch.float32, copy=True)

    def close(self) -> None:
        self.tensor = None
        if self._shm is not None:
            shm, self._shm = self._shm, None
            with contextlib.suppress(BufferError):
                shm.close()


def _open_cuda(handle: HiddenHandle) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    f = json.loads(handle.handle.decode())
    dtype = DTYPES[handle.dtype]
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(int(x) for x in f["size"]), tuple(int(x) for x in f["stride"]), int(f["offset"]),
        torch.storage.TypedStorage, dtype, int(f["device"]), bytes.fromhex(f["handle"]), int(f["storage_bytes"]),
        int(f["storage_offset"]), False, bytes.fromhex(f["ref_handle"]), int(f["ref_offset"]),
        bytes.fromhex(f["event_handle"]) or None, bool(f["event_sync"]),
    )
