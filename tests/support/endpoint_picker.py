"""Messages a gateway sends the endpoint picker (Envoy's ext_proc), built with the generated stubs: the
request's headers (with a body mode and a subset hint) and its body."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

MODES = processing_mode_pb2.ProcessingMode


def headers_msg(
    path: str = "/v1/chat/completions",
    mode: int = MODES.BUFFERED,
    end: bool = False,
    subset: list[str] | None = None,
) -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
                    base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                ]
            ),
            end_of_stream=end,
        ),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def body_msg(body: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end))


def picked(stub: ep_grpc.ExternalProcessorStub, path: str, body: bytes) -> ep.HeaderMutation:
    """What the picker tells the gateway to change in a buffered request to `path` with `body`: the
    headers it sets (the chosen endpoint, and a data-parallel pod's rank) and removes."""
    (_, reply) = stub.Process(iter([headers_msg(path), body_msg(body)]), timeout=60)
    return reply.request_body.response.header_mutation
