"""A hostile gRPC caller on a plain socket: HTTP/2 frames written by hand (no gRPC library between the test and
the server), so a test sees exactly when the server answers and how much it let the caller send.

``RawCall`` opens a connection, sends one call's headers (HPACK literals, no indexing) and then pushes a message
of a declared length in DATA frames as fast as the server's flow-control windows allow, until the server ends the
stream (trailers, RST_STREAM), closes the connection, or the message is all sent."""

from __future__ import annotations

import socket
import struct
import threading
import time

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, END_HEADERS, ACK = 1, 4, 1
FRAME = 16384  # the default SETTINGS_MAX_FRAME_SIZE


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (lengths < 127)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def grpc_status(block: bytes) -> int | None:
    """grpc-status from a header block whose field the server wrote as a plain literal (gRPC core does), else None."""
    at = block.find(b"grpc-status")
    if at < 0:
        return None
    size = block[at + len(b"grpc-status")] & 0x7F
    value = block[at + len(b"grpc-status") + 1 : at + len(b"grpc-status") + 1 + size]
    return int(value) if value.isdigit() else None


class RawCall:
    def __init__(self, host: str, port: int, path: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Condition()
        self.stream_window = self.conn_window = 65535
        self.ended_at: float | None = None  # trailers or RST_STREAM of the call, or the connection closed
        self.trailers = b""
        self.reset = False
        self.closed = False
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "x"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.sock.sendall(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            + _frame(SETTINGS, 0, 0)
            + _frame(HEADERS, END_HEADERS, 1, b"".join(_literal(k, v) for k, v in headers))
        )
        self.started = time.perf_counter()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._lock:
                    self.closed = True
                    self.ended_at = self.ended_at or time.perf_counter()
                    self._lock.notify_all()
                return
            buf += chunk
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                size = int.from_bytes(buf[:3], "big")
                kind, flags, stream, payload = (
                    buf[3],
                    buf[4],
                    int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF,
                    buf[9 : 9 + size],
                )
                buf = buf[9 + size :]
                self._on_frame(kind, flags, stream, payload)

    def _on_frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        with self._lock:
            if kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload), 6):
                    key, value = struct.unpack(">HI", payload[i : i + 6])
                    if key == 4:  # SETTINGS_INITIAL_WINDOW_SIZE
                        self.stream_window += value - 65535
                self._send(_frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                self._send(_frame(PING, ACK, 0, payload))
            elif kind == WINDOW_UPDATE:
                grant = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                if stream == 0:
                    self.conn_window += grant
                else:
                    self.stream_window += grant
            elif kind == HEADERS and stream == 1 and flags & END_STREAM:
                self.trailers += payload
                self.ended_at = self.ended_at or time.perf_counter()
            elif kind == RST_STREAM and stream == 1:
                self.reset = True
                self.ended_at = self.ended_at or time.perf_counter()
            self._lock.notify_all()

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True

    def push(self, message_len: int, head: bytes, deadline_s: float) -> int:
        """Send a gRPC message of ``message_len`` bytes (``head`` first, then filler) while the windows allow; stop
        when the call ends, the connection closes or ``deadline_s`` passes. Returns the bytes sent."""
        body = struct.pack(">BI", 0, message_len) + head
        sent, total = 0, 5 + message_len
        filler = b"\x00" * FRAME
        end = self.started + deadline_s
        while sent < total:
            with self._lock:
                while not (self.ended_at or self.closed) and min(self.stream_window, self.conn_window) <= 0:
                    if not self._lock.wait(timeout=max(0.0, end - time.perf_counter())):
                        return sent
                if self.ended_at or self.closed or time.perf_counter() > end:
                    return sent
                size = min(FRAME, self.stream_window, self.conn_window, total - sent)
                self.stream_window -= size
                self.conn_window -= size
            chunk = body[sent : sent + size] if sent < len(body) else b""
            chunk += filler[: size - len(chunk)]
            flags = END_STREAM if sent + size == total else 0
            try:
                self.sock.sendall(_frame(DATA, flags, 1, chunk))
            except OSError:
                return sent
            sent += size
        return sent

    def wait_end(self, timeout_s: float) -> float | None:
        """Seconds from the call's start to its end (None: not within timeout_s of now)."""
        with self._lock:
            self._lock.wait_for(lambda: self.ended_at is not None, timeout=timeout_s)
            return None if self.ended_at is None else self.ended_at - self.started

    def close(self) -> None:
        self.sock.close()
