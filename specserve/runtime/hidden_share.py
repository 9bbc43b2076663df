"""A session's target hidden rows shared on one host: the target writes each step's committed rows into
a per-session buffer, the drafter maps the buffer once and reads the rows there; the gateway relays only
the buffer's handle (once per session) and which rows are new (a row range per step).

Two kinds behind one interface, picked from the target tensor's device:

- ``host_shm``: a sealed memfd holding the [rows, cols] tensor (CPU targets; what CI tests), which nobody, the
  target included, can shrink under the drafter's mapping (specserve/runtime/shm_memfd.py). It has no name: the
  target offers its descriptor at a socket of its own in /dev/shm (specserve/runtime/hidden_fds.py), to the one
  caller that presents the session's 256-bit random key; the handle carries the socket's name and that key, and
  the drafter fetches the descriptor (``fetch_segment``), checks its seals and size, and maps it (``HiddenView``)
  only then. /dev/shm is world-listable, so the name is no secret: a caller with another key is hung up on
  (PERMISSION_DENIED at the drafter), so whoever lists /dev/shm cannot have a session's rows mapped or its offer
  taken, and a ring's socket never hands its segment to a drafter (nor a buffer's to a gateway: the hand-over's
  byte says which). The segment still starts with a header (a magic and the key) that the drafter checks after
  mapping. Names and leaks: the socket is created mode 0600 and named ``specserve-<96-bit random token>``; the
  offer ends, and the name goes, when the drafter has taken the descriptor, at the session's first verify step
  (by then the drafter has it or never will) or at the buffer's end, so while the session runs nothing is left
  by name and a SIGKILL of either side leaves nothing. Only a target killed between its Prefill reply and the
  drafter's fetch leaves the name (a socket; the same window as a ring's offer).
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
from pathlib import Path

import numpy as np
import torch

from specserve.protos.specserve.v1 import common_pb2
from specserve.runtime.hidden_fds import HIDDEN_TAG, TAKEN, FdServer
from specserve.runtime.shm_layout import NAME_PREFIX, SHM_DIR
from specserve.runtime.shm_memfd import (
    KEY_BYTES,
    HungUp,
    Segment,
    SegmentRefused,
    ask_for_fds,
    check_sealed,
    make_sealed,
)

HIDDEN_SHARE_ENV = "SPECSERVE_HIDDEN_SHARE"  # "0": hidden rows always as bytes (flag: --no-hidden-share)
HOST_SHM, CUDA_IPC = "host_shm", "cuda_ipc"
KINDS = (HOST_SHM, CUDA_IPC)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HANDLE_BYTES = 4096
_MAGIC = b"specserve-hidden-rows-v1"  # a host_shm segment's header: the magic, then the session's key
_KEY_BYTES = KEY_BYTES
FETCH_TIMEOUT_S = 2.0  # a drafter waits this long for the target to hand a buffer's segment over
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
            raise HiddenShareError(
                f"hidden_share.shape: [{self.rows}, {self.cols}] is not a [rows >= 1, cols >= 1] buffer"
            )
        if self.dtype not in DTYPES:
            raise HiddenShareError(f"hidden_share.dtype: {self.dtype[:40]!r} is not one of {sorted(DTYPES)}")
        if not 0 < len(self.handle) <= MAX_HANDLE_BYTES:
            raise HiddenShareError(f"hidden_share.handle: {len(self.handle)} bytes (expected 1..{MAX_HANDLE_BYTES})")

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * DTYPES[self.dtype].itemsize

    def to_proto(self) -> common_pb2.HiddenShare:
        return common_pb2.HiddenShare(
            kind=self.kind, shape=[self.rows, self.cols], dtype=self.dtype, handle=self.handle
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.HiddenShare) -> HiddenHandle:
        if len(msg.shape) != 2:
            raise HiddenShareError(f"hidden_share.shape: {list(msg.shape)[:4]} is not [rows, cols]")
        return cls(msg.kind, int(msg.shape[0]), int(msg.shape[1]), msg.dtype, bytes(msg.handle))


# ------------------------------------------------------------------------------------------ the target's end
class HiddenBuffer:
    """The target's buffer of one session: ``tensor`` [rows, cols] in the engine's dtype on its device,
    and the ``handle`` to hand over once. ``withdraw`` ends a host_shm buffer's offer (its name goes;
    idempotent); ``close`` frees the buffer (the drafter's mapping, if any, stays valid until it closes its own)."""

    def __init__(
        self,
        tensor: torch.Tensor,
        handle: HiddenHandle,
        shm: Segment | None,
        server: FdServer | None = None,
        offer: str = "",
    ) -> None:
        self.tensor = tensor  # [rows, cols]
        self.handle = handle
        self._shm = shm
        self._server, self._offer = server, offer

    @property
    def rows(self) -> int:
        return self.handle.rows

    @classmethod
    def create(
        cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device | str, server: FdServer | None = None
    ) -> HiddenBuffer:
        """Raises HiddenShareError (a dtype with no name here, no room for a segment, no device memory, no
        ``server`` to offer a host_shm segment from)."""
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
        if server is None:
            raise HiddenShareError("no hidden share: nothing serves host_shm segments here")
        key = secrets.token_bytes(_KEY_BYTES)
        nbytes = rows * cols * dtype.itemsize
        try:
            fd = make_sealed("specserve-hidden", _HEADER + nbytes)
        except OSError as exc:
            raise HiddenShareError(f"no shared segment of {nbytes} bytes: {exc}") from None
        try:
            shm = Segment(fd, _HEADER + nbytes)
            shm.buf[: len(_MAGIC) + _KEY_BYTES] = _MAGIC + key
            name = server.offer(fd, key)  # the server holds the descriptor from here
        except OSError as exc:
            os.close(fd)
            raise HiddenShareError(f"no shared segment of {nbytes} bytes: {exc}") from None
        handle = HiddenHandle(HOST_SHM, rows, cols, name_of_dtype, f"{name}:{key.hex()}".encode())
        return cls(_segment_tensor(shm, rows, cols, dtype), handle, shm, server, name)

    def withdraw(self) -> None:
        if self._offer:
            offer, self._offer = self._offer, ""
            self._server.withdraw(offer)

    def close(self) -> None:
        self.withdraw()
        on_cuda = self.tensor is not None and self.tensor.is_cuda
        self.tensor = None
        if on_cuda:  # memory a drafter still mapped waits in torch's IPC limbo: free what it has let go
            torch.cuda.ipc_collect()
        if self._shm is not None:
            shm, self._shm = self._shm, None
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with it
                shm.close()

    @property
    def mapped(self) -> bool:
        """Whether this buffer's segment is still mapped here (tests: a close under a live view leaves it)."""
        return self._shm is not None


def _segment_tensor(shm: Segment, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:  # [rows, cols]
    """A tensor over the segment's rows (after its header) that pins its mapping: numpy holds a buffer
    export of it, so the segment cannot be unmapped (close raises BufferError) while any tensor over it
    lives (torch.frombuffer would not pin it: a close under a live tensor is a use after unmap)."""
    raw = np.frombuffer(shm.buf, dtype=np.uint8, count=rows * cols * dtype.itemsize, offset=_HEADER)
    return torch.from_numpy(raw).view(dtype).view(rows, cols)


def _shm_name_and_key(handle: HiddenHandle) -> tuple[str, bytes]:
    """A host_shm handle's segment name and key (HiddenShareError when it is not one)."""
    name, sep, key_hex = handle.handle.decode("utf-8", "replace").partition(":")
    if not _SEGMENT_NAME.fullmatch(name):  # what create makes: never a path
        raise HiddenShareError(f"hidden_share: {name[:70]!r} is not a specserve segment name")
    try:
        key = bytes.fromhex(key_hex)
    except ValueError:
        key = b""
    if not sep or len(key) != _KEY_BYTES:
        raise HiddenShareError(f"hidden_share: the handle of {name} carries no {_KEY_BYTES}-byte key")
    return name, key


def _cuda_handle(tensor: torch.Tensor) -> bytes:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (
        _,
        size,
        stride,
        offset,
        _,
        _,
        device,
        handle,
        storage_bytes,
        storage_offset,
        _,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = args
    fields = dict(
        size=list(size),
        stride=list(stride),
        offset=int(offset),
        device=int(device),
        handle=bytes(handle).hex(),
        storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset),
        ref_handle=bytes(ref_handle).hex(),
        ref_offset=int(ref_offset),
        event_handle=bytes(event_handle or b"").hex(),
        event_sync=bool(event_sync),
    )
    return json.dumps(fields, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------------------- the drafter's end
def fetch_segment(handle: HiddenHandle, timeout: float = FETCH_TIMEOUT_S) -> int:
    """A host_shm buffer's segment, from the target that offers it (blocking up to ``timeout``: call it off the
    drafter's thread), checked before anything maps it: sealed against resizing (a drafter that maps memory whose
    size a peer controls dies of SIGBUS when the peer truncates it), as large as the handle says, its header
    holding the handle's key. Returns its descriptor (``HiddenView.open`` maps and closes it); the offer ends then.
    Raises HiddenShareDenied when the offer's owner does not know the handle's key (or the segment's header says
    another key), HiddenShareError when nothing offers it here (another host, a target gone, an offer taken or
    withdrawn) or what is handed over is not that buffer's segment (the offer stays)."""
    name, key = _shm_name_and_key(handle)
    try:
        sock, (fd,) = ask_for_fds(name, key, HIDDEN_TAG, 1, timeout)
    except HungUp:
        raise HiddenShareDenied(f"hidden_share: {name} is not the buffer this handle's key opens") from None
    except SegmentRefused as exc:
        raise HiddenShareError(f"hidden_share: {exc}") from None
    except OSError as exc:
        raise HiddenShareError(f"hidden_share: cannot open segment {name}: {exc.strerror or exc}") from None
    with sock:
        try:
            _check_segment(fd, name, key, handle)
            with contextlib.suppress(OSError):
                sock.send(TAKEN)
                sock.recv(1)  # the owner hangs up once the offer (and its name) is gone
        except BaseException:
            os.close(fd)
            raise
    return fd


def _check_segment(fd: int, name: str, key: bytes, handle: HiddenHandle) -> None:
    try:
        size = check_sealed(fd)
    except SegmentRefused as exc:
        raise HiddenShareError(f"hidden_share: {name}: {exc}") from None
    if size < _HEADER + handle.nbytes:
        raise HiddenShareError(
            f"hidden_share: segment {name} has {max(0, size - _HEADER)} bytes of rows, the "
            f"handle's [{handle.rows}, {handle.cols}] {handle.dtype} needs {handle.nbytes}"
        )
    if not hmac.compare_digest(os.pread(fd, len(_MAGIC) + _KEY_BYTES, 0), _MAGIC + key):
        raise HiddenShareDenied(f"hidden_share: segment {name} is not the buffer this handle's key opens")


class HiddenView:
    """The drafter's mapping of one session's buffer. ``read(start, stop)`` copies rows out as float32 on
    the buffer's device (the values the byte path gives, so a drafter drafts exactly the same block)."""

    def __init__(self, tensor: torch.Tensor, handle: HiddenHandle, shm: Segment | None) -> None:
        self.tensor = tensor  # [rows, cols], the target's memory
        self.handle = handle
        self._shm = shm

    @classmethod
    def open(cls, handle: HiddenHandle, fd: int = -1) -> HiddenView:
        """Map the buffer (host_shm: the descriptor ``fetch_segment`` gave, taken over and closed here; fetched
        here when none is given). Raises HiddenShareError."""
        if handle.kind == HOST_SHM:
            return cls._open_shm(handle, fetch_segment(handle) if fd < 0 else fd)
        if not torch.cuda.is_available():
            raise HiddenShareError("hidden_share: a cuda_ipc buffer, but this process has no CUDA")
        try:
            tensor = _open_cuda(handle)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise HiddenShareError(f"hidden_share: cannot open the cuda_ipc handle: {str(exc)[:200]}") from None
        if tuple(tensor.shape) != (handle.rows, handle.cols) or tensor.dtype != DTYPES[handle.dtype]:
            raise HiddenShareError(
                f"hidden_share: the cuda_ipc buffer is {tuple(tensor.shape)} {tensor.dtype}, "
                f"the handle says [{handle.rows}, {handle.cols}] {handle.dtype}"
            )
        return cls(tensor, handle, None)

    @classmethod
    def _open_shm(cls, handle: HiddenHandle, fd: int) -> HiddenView:
        """Map a segment ``fetch_segment`` checked (sealed: its size cannot change since)."""
        try:
            shm = Segment(fd, _HEADER + handle.nbytes)
        finally:
            os.close(fd)  # the mapping holds the segment
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
        torch.Tensor,
        torch.Size(int(x) for x in f["size"]),
        tuple(int(x) for x in f["stride"]),
        int(f["offset"]),
        torch.storage.TypedStorage,
        dtype,
        int(f["device"]),
        bytes.fromhex(f["handle"]),
        int(f["storage_bytes"]),
        int(f["storage_offset"]),
        False,
        bytes.fromhex(f["ref_handle"]),
        int(f["ref_offset"]),
        bytes.fromhex(f["event_handle"]) or None,
        bool(f["event_sync"]),
    )
