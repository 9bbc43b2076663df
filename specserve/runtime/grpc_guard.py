"""What a specserve gRPC server does before any handler runs (issue #44): who may send a message, how big it may
be, and how many connections a listener holds.

- ``BearerAuth``: with ``--auth-token`` a call without the token is refused from its metadata alone. The refusal
  is a streaming handler that reads no message: the request's bytes are never buffered whole, never deserialized
  (gRPC answers with the status and resets the stream, so the caller's HTTP/2 window is all it ever had in flight).
  Only the health check (``Health/Check``: probes) is open; ``Health/Watch`` and reflection need the token, so a
  caller without it can hold no call open, and its connection goes idle (dropped, below).
- Receive limits sized from the largest honest message (``target_receive_bytes``, ``draft_receive_bytes``):
  gRPC checks a message's length prefix against the limit before it allocates the message.
- ``ConnectionLimits``: per listen address, at most ``max_connections`` open (one more is closed as it is
  accepted: gRPC's ``grpc.max_allowed_incoming_connections``), a connection that has not finished its HTTP/2
  handshake within ``handshake_s`` and one that carries no call for ``idle_s`` are closed (a client's channel
  reconnects by itself at its next call). The cap comes from the process's file descriptors (``fd_budget``), so
  one peer never exhausts them: the other listen addresses (a unix socket of ``serve``, the HTTP port) keep theirs,
  and a connection that carries calls is never dropped for a new one.
"""

from __future__ import annotations

import hmac
import resource
from dataclasses import dataclass

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/Check",)  # answered without a token (health probes)
UNAUTHENTICATED_MESSAGE = "authorization: missing or wrong bearer token"
FD_RESERVE = 256  # descriptors kept for the process itself (checkpoint files, pipes, shared memory, the loop)
RECEIVE_SLACK_BYTES = 1 << 20  # beyond a message's sized fields: session ids, trace context, framing
VARINT_BYTES = 5  # most bytes of one non-negative int32 in a repeated field


def bearer_matches(metadata, token: bytes) -> bool:
    """Whether the call's metadata carries ``authorization: Bearer <token>`` (constant-time compare)."""
    given = b""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            given = raw[len(b"Bearer ") :] if raw[:7].lower() == b"bearer " else b""
            break
    return hmac.compare_digest(given, token)


async def _refuse(_requests, context):
    """A call without the token: refused before any message of it is read."""
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
    yield  # an async generator: gRPC's streaming handler shape


_REFUSE = grpc.stream_stream_rpc_method_handler(_refuse)  # no deserializer: nothing is parsed


class BearerAuth(grpc.aio.ServerInterceptor):
    """Every call but the health check must carry the bearer token, or gets UNAUTHENTICATED unread."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS or bearer_matches(details.invocation_metadata, self._token):
            return await continuation(details)
        return _REFUSE


def target_receive_bytes(vocab_size: int, max_context: int, max_draft_tokens: int, num_layers: int) -> int:
    """The largest honest request to a target: a Prefill of a whole context's ids naming every layer, or a verify
    step of ``max_draft_tokens`` nodes (ids, parents) with their float32 draft rows [n, vocab]."""
    prefill = (max_context + num_layers) * VARINT_BYTES
    verify = max_draft_tokens * (2 * VARINT_BYTES + 4 * vocab_size)
    return max(prefill, verify) + RECEIVE_SLACK_BYTES


def draft_receive_bytes(max_tokens: int, feature_width: int | None, needs_hidden: bool) -> int | None:
    """The largest honest request to a draft: a StartSession of ``max_tokens`` ids (its --max-total-tokens bounds any
    one session's) with their float32 hidden rows [n, F] when the drafter reads them; None when it reads rows of a
    width it does not state (no bound below the configured one)."""
    if needs_hidden and feature_width is None:
        return None
    row = 4 * feature_width if needs_hidden else 0
    return max_tokens * (VARINT_BYTES + row) + RECEIVE_SLACK_BYTES


def raise_fd_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (connections are descriptors); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def fd_budget(fd_limit: int, listeners: int, others: int = 0) -> int:
    """Connections one listen address may hold: the descriptors left after the process's own reserve (a quarter, at
    least FD_RESERVE) and ``others`` (an HTTP server's cap), shared by ``listeners`` (at least 16 each)."""
    spare = fd_limit - max(FD_RESERVE, fd_limit // 4) - others
    return max(16, spare // max(1, listeners))


# specserve's own channels close a connection idle this long themselves (gRPC's client idle timeout, which may fire up
# to twice as late), well before a server's idle_s: their connections never meet the server's idle close, whose
# GOAWAY gRPC logs at the client and which a call starting at that moment could meet
CLIENT_IDLE_S = 3.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int | None = None  # per listen address; None: fd_budget at start
    handshake_s: float = 3.0  # TCP accepted, HTTP/2 settings not exchanged: closed after this
    idle_s: float = 10.0  # no call in flight for this long: closed (GOAWAY; the client reconnects when it calls)

    def __post_init__(self) -> None:
        if self.idle_s <= 2 * CLIENT_IDLE_S:
            raise ValueError(f"idle_s must be > {2 * CLIENT_IDLE_S} (twice the clients' idle close), got {self.idle_s}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("handshake_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def options(self, listeners: int, others: int = 0) -> list[tuple[str, int]]:
        cap = self.max_connections or fd_budget(raise_fd_limit(), listeners, others)
        return [
            ("grpc.max_allowed_incoming_connections", cap),
            ("grpc.server_handshake_timeout_ms", int(self.handshake_s * 1000)),
            ("grpc.max_connection_idle_ms", int(self.idle_s * 1000)),
        ]
