"""How a service's exceptions become gRPC status codes: one mapping, each server adds its own specific errors."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from specserve.errors import SpecserveError


class LimitExceeded(SpecserveError):
    """A request over one of the service's configured limits (the message names the flag)."""


def status_for(
    exc: BaseException,
    input_errors: tuple[type[BaseException], ...],
    specific: Sequence[tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode]] = (),
) -> grpc.StatusCode:
    """The first of `specific` that matches, else INVALID_ARGUMENT for errors caused by the request's content
    (`input_errors`), else INTERNAL."""
    for kinds, code in specific:
        if isinstance(exc, kinds):
            return code
    if isinstance(exc, input_errors):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
