"""The Gateway service's gRPC method handlers: gateway_pb2_grpc's registration, but a request whose bytes do not
parse reaches the servicer as a MalformedMessage (answered INVALID_ARGUMENT) instead of gRPC's generic UNKNOWN."""

from __future__ import annotations

import grpc

from specserve.protos.specserve.v1 import gateway_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class MalformedMessage:
    """A request whose bytes do not parse (the lenient deserializer's result; answered INVALID_ARGUMENT)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.problem = f"request: not a valid {type_name} message ({type(error).__name__}: {str(error)[:200]})"


def _lenient(message_cls):
    def parse(data: bytes):
        try:
            return message_cls.FromString(data)
        except Exception as exc:  # noqa: BLE001 - any decode failure: the handler answers INVALID_ARGUMENT
            return MalformedMessage(message_cls.DESCRIPTOR.full_name, exc)

    return parse


def add_gateway_to_server(servicer, server) -> None:
    """gateway_pb2_grpc.add_GatewayServicer_to_server, but bytes that do not parse reach the servicer as
    a MalformedMessage (INVALID_ARGUMENT with a message) instead of gRPC's generic UNKNOWN."""
    pb = gateway_pb2
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, _lenient(pb.GenerateRequest), pb.GenerateResponse.SerializeToString
        ),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(
            servicer.GenerateUnary, _lenient(pb.GenerateRequest), pb.GenerateResult.SerializeToString
        ),
        "SetDraft": grpc.unary_unary_rpc_method_handler(
            servicer.SetDraft, _lenient(pb.SetDraftRequest), pb.SetDraftResponse.SerializeToString
        ),
        "ListDrafts": grpc.unary_unary_rpc_method_handler(
            servicer.ListDrafts, _lenient(pb.ListDraftsRequest), pb.ListDraftsResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
