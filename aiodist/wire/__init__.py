"""Sans-I/O protocol code: pure encode/decode on bytes. Nothing here imports asyncio or socket."""

from aiodist.wire.store import (
    MAGIC,
    Limits,
    Op,
    ProtocolError,
    Reply,
    ReplyParser,
    Request,
    RequestParser,
    encode,
    encode_request,
)

__all__ = ["MAGIC", "Limits", "Op", "ProtocolError", "Reply", "ReplyParser", "Request", "RequestParser", "encode", "encode_request"]
