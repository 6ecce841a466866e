"""What crosses the wire besides the generated code: status errors and their bounded messages, and
the GenerateRequest decoder that names a string field whose bytes are not UTF-8 (protobuf only says
that decoding failed)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf.message import DecodeError

from jaxspec.serving.proto.jaxspec.v1 import generation_pb2 as pb

ECHO_CHARS = 200  # a client's value echoed in a status message is cut to this many characters
DETAILS_CHARS = 1000  # a status message is cut to this many characters
RETRY_PUSHBACK_MS = 100  # the grpc-retry-pushback-ms trailer of every "busy" RESOURCE_EXHAUSTED (gRFC A6)


class RpcError(Exception):
    """Ends a call with `code` and `message` (the handlers turn it into context.abort)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_later: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_later = retry_later


def invalid(message: str) -> RpcError:
    """An INVALID_ARGUMENT error with `message`."""
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def busy(message: str) -> RpcError:
    """A RESOURCE_EXHAUSTED error that means "busy, retry later" (see `abort`)."""
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_later=True)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text`, cut to `limit` characters with an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"


def shown(value: object) -> str:
    """How a client's value appears in a status message: its repr, cut to ECHO_CHARS characters."""
    return clip(repr(value))


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str, retry_later: bool = False):
    """End the call (raises); the message is cut to DETAILS_CHARS, whatever it echoes. retry_later:
    add the trailer grpc-retry-pushback-ms (the server is busy). gRPC's own RESOURCE_EXHAUSTED, for a
    message over its transport limit, has no such trailer: it is not retryable."""
    if retry_later:
        context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
    context.abort(code, clip(message, DETAILS_CHARS))


def parse_generate_request(data: bytes) -> pb.GenerateRequest:
    """Deserialise a GenerateRequest; malformed bytes (e.g. invalid UTF-8 in a string field, which
    protobuf refuses) raise INVALID_ARGUMENT naming the field, not gRPC's generic INTERNAL."""
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        field = _bad_utf8_field(data, pb.GenerateRequest.DESCRIPTOR)
        if field is not None:
            raise invalid(f"field '{field}' is not valid UTF-8") from None
        raise invalid(f"malformed GenerateRequest: {clip(str(exc))}") from None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _bad_utf8_field(data: bytes, message: _descriptor.Descriptor, prefix: str = "") -> str | None:
    """The path (e.g. 'messages[0].content') of the first string field whose bytes are not UTF-8."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + size], pos + size
                field = message.fields_by_number.get(number)
                if field is None:
                    continue
                index = seen[number] = seen.get(number, -1) + 1
                name = prefix + field.name + (f"[{index}]" if _is_repeated(field) else "")
                if field.type == _descriptor.FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == _descriptor.FieldDescriptor.TYPE_MESSAGE:
                    found = _bad_utf8_field(chunk, field.message_type, name + ".")
                    if found is not None:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _is_repeated(field: _descriptor.FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # newer protobuf; `label` is deprecated there
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


__all__ = ["DETAILS_CHARS", "ECHO_CHARS", "RETRY_PUSHBACK_MS", "RpcError", "abort", "busy", "clip", "invalid",
           "parse_generate_request", "shown"]
