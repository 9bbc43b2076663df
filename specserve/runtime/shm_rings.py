"""The two rings of one shared-memory channel end (specserve/runtime/shm_ring.py is the channel): two
single-producer / single-consumer byte streams in its segment (specserve/runtime/shm_layout.py), the one this end
writes and the one it reads, and the messages read from the second.

A message is a u32 length and its bytes, written as a byte stream modulo C (it may wrap); one larger
than C goes through in pieces while the reader drains it (back-pressure: the writer waits for room).
Each end refuses an incoming length above its own ``RingConfig.max_message`` (by default the services'
gRPC message limit) before it allocates anything, and grows a message's buffer only with bytes that
have arrived: a peer cannot make a reader commit memory it did not send. A writer checks the
reader's published limit first (``MessageTooLarge``, nothing written), as gRPC refuses a message
over the peer's limit. Head and tail only grow; the writer stores the bytes before it publishes the head, the reader
reads the bytes before it publishes the tail (aligned 8-byte stores are atomic and stay in order on
x86-64; other CPUs are not claimed).
"""

from __future__ import annotations

from specserve.runtime.shm_errors import MessageTooLarge
from specserve.runtime.shm_layout import CONTROL, HEAD, LEN, LIMIT, MAX_MESSAGE, RING_CTRL, TAIL, U32, U64, WAITING


class Rings:
    """One end's two rings: ``out`` (this end writes it; the creator's is ring 0) and ``in`` (it reads it), over
    the segment's buffer; and what has arrived of the message being read."""

    def __init__(self, buf: memoryview, creator: bool, capacity: int, max_message: int) -> None:
        self.capacity = capacity
        self.max_message = max_message  # what this end reads
        self._buf = buf
        self._out_ctrl, self._in_ctrl = (RING_CTRL[0], RING_CTRL[1]) if creator else (RING_CTRL[1], RING_CTRL[0])
        self._out_data = CONTROL + (0 if creator else capacity)
        self._in_data = CONTROL + (capacity if creator else 0)
        self._partial: bytearray | None = None  # a message being read: the bytes that have arrived of it
        self._partial_len = 0  # its length (from its prefix)

    def release(self) -> None:
        """Drop the buffer (the segment can close) and what had arrived of a message."""
        self._buf = None
        self._partial = None

    # ---------------------------------------------------------------------------- ring words
    def _get(self, off: int) -> int:
        return U64.unpack_from(self._buf, off)[0]

    def _put(self, off: int, value: int) -> None:
        U64.pack_into(self._buf, off, value)

    def readable(self) -> int:
        return self._get(self._in_ctrl + HEAD) - self._get(self._in_ctrl + TAIL)

    def room(self) -> int:
        return self.capacity - (self._get(self._out_ctrl + HEAD) - self._get(self._out_ctrl + TAIL))

    def publish_limit(self) -> None:
        """Tell the peer's writer the largest message this end reads."""
        self._put(self._in_ctrl + LIMIT, self.max_message)

    def peer_max_message(self) -> int:
        """The largest message the peer reads (what it published; a u32 length's most before it has)."""
        return self._get(self._out_ctrl + LIMIT) or MAX_MESSAGE

    def mark_waiting(self) -> None:
        """This end's writer waits for room (its reader rings when it frees some)."""
        self._put(self._out_ctrl + WAITING, 1)

    def peer_waiting(self) -> bool:
        """The peer's writer waits for room (this end rings it when it frees some)."""
        return bool(self._get(self._in_ctrl + WAITING))

    def clear_peer_waiting(self) -> None:
        self._put(self._in_ctrl + WAITING, 0)

    # ---------------------------------------------------------------------------- writing
    def frame(self, payload: bytes | bytearray | memoryview) -> list[memoryview]:
        view = memoryview(payload).cast("B")
        limit = self.peer_max_message()
        if len(view) > limit:
            raise MessageTooLarge(f"a message of {len(view)} bytes exceeds the peer's limit of {limit}")
        return [memoryview(U32.pack(len(view))), view]

    def write_some(self, parts: list[memoryview], done: int) -> int:
        """Copy what fits of the concatenated parts from byte ``done`` on; publish; return bytes written."""
        room = self.room()
        if room <= 0:
            return 0
        head = self._get(self._out_ctrl + HEAD)
        wrote, skip = 0, done
        for part in parts:
            if skip >= len(part):
                skip -= len(part)
                continue
            chunk = part[skip : skip + (room - wrote)]
            skip = 0
            pos = (head + wrote) % self.capacity
            first = min(len(chunk), self.capacity - pos)
            base = self._out_data
            self._buf[base + pos : base + pos + first] = chunk[:first]
            if first < len(chunk):
                self._buf[base : base + len(chunk) - first] = chunk[first:]
            wrote += len(chunk)
            if wrote >= room:
                break
        self._put(self._out_ctrl + HEAD, head + wrote)
        return wrote

    # ---------------------------------------------------------------------------- reading
    def _read_into(self, dst: memoryview, n: int) -> None:
        tail = self._get(self._in_ctrl + TAIL)
        pos = tail % self.capacity
        first = min(n, self.capacity - pos)
        base = self._in_data
        dst[:first] = self._buf[base + pos : base + pos + first]
        if first < n:
            dst[first:n] = self._buf[base : base + n - first]
        self._put(self._in_ctrl + TAIL, tail + n)

    def _read_append(self, dst: bytearray, n: int) -> None:
        """Append the next n bytes of the ring to dst (it grows by what has arrived, never ahead of it)."""
        tail = self._get(self._in_ctrl + TAIL)
        pos = tail % self.capacity
        first = min(n, self.capacity - pos)
        base = self._in_data
        dst += self._buf[base + pos : base + pos + first]
        if first < n:
            dst += self._buf[base : base + n - first]
        self._put(self._in_ctrl + TAIL, tail + n)

    def read_message(self) -> tuple[bytes | None, bool]:
        """(a whole message if one is there, whether ring space was freed): consumes what is there of a longer
        one. MessageTooLarge at a prefix over this end's limit, before a byte of it is allocated."""
        freed = False
        while True:
            avail = self.readable()
            if self._partial is None:
                if avail < LEN:
                    break
                hdr = bytearray(LEN)
                self._read_into(memoryview(hdr), LEN)
                freed = True
                (length,) = U32.unpack(hdr)
                if length > self.max_message:  # refused before a byte of it is allocated
                    raise MessageTooLarge(
                        f"the peer sent a message of {length} bytes; this end reads at most {self.max_message}"
                    )
                self._partial, self._partial_len = bytearray(), length
                avail -= LEN
            n = min(self._partial_len - len(self._partial), avail)
            if n:
                self._read_append(self._partial, n)
                freed = True
            if len(self._partial) == self._partial_len:
                msg, self._partial = bytes(self._partial), None
                return msg, freed
            if not n:
                break
        return None, freed

    def can_read(self) -> bool:
        """A read would make progress (a length prefix is read whole)."""
        return self.readable() >= (LEN if self._partial is None else 1)
