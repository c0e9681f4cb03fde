"""Serving the gRPC services: registration with tolerant deserializers, and the wrappers every servicer
method goes through (the request checked by ``validate``, errors turned into status codes).

Errors cross the wire as status codes from one table (each ``XpudError`` class has its code); anything
unexpected is logged and answered INTERNAL, so the daemon never dies on a bad request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc import aio

from xpud.api import validate
from xpud.api.v1 import xpu_pb2 as pb
from xpud.api.v1 import xpu_pb2_grpc as pbg
from xpud.errors import XpudError

log = logging.getLogger("xpud.api.server")


def _status(e: XpudError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)


def _detail(e: XpudError) -> str:
    """The error's message, bounded (status details travel in HTTP/2 headers, which have a size limit)."""
    return validate.clip(str(e), 1000)


async def _abort(context: aio.ServicerContext, method: str, e: XpudError) -> None:
    """End the call with the error's status and its one line. An INTERNAL one (a driver error no backend
    translated, a rank that could not start) is a fault of this host: its traceback goes to the log too."""
    status = _status(e)
    if status is grpc.StatusCode.INTERNAL:
        log.error("%s failed: %s", method, e, exc_info=e)
    await context.abort(status, _detail(e))


def add_to_server(servicer: Any, server: aio.Server) -> None:
    """Register ``servicer`` (a Node, Admin or Peer servicer) on ``server``, as the generated
    ``add_*Servicer_to_server`` does, but with deserializers that let a corrupt message be refused with
    INVALID_ARGUMENT (``validate.tolerant``) instead of UNKNOWN and a traceback.

    As a generic handler only, not also as registered methods (the generated code does both): grpc.aio's
    server keeps one pending request per registered method and waits on all of them
    (``asyncio.wait``) for every call it accepts, a callback added and removed on each of the 17 futures
    per call; generic only, it waits on one (-4 % of the daemon's instructions per grant+release cycle,
    ``bench/instructions.py``)."""
    if isinstance(servicer, pbg.AdminServicer):
        name = "Admin"
    elif isinstance(servicer, pbg.PeerServicer):
        name = "Peer"
    else:
        name = "Node"
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for m in service.methods:
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = kind(
            getattr(servicer, m.name),
            request_deserializer=validate.tolerant(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def unary(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            validate.check(request)
            return await fn(self, request, context)
        except aio.AbortError:
            raise
        except XpudError as e:
            await _abort(context, fn.__name__, e)
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the daemon log"
            )

    return wrapper


def streaming(fn: Callable) -> Callable:
    """A server-streaming method; for a client stream too (``request`` an async iterator), each message is
    checked as it arrives."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, _ONE_MESSAGE):  # (not hasattr: a message raises inside it, ~1 us)
                validate.check(request)
            else:
                request = _checked(request)
            async for item in fn(self, request, context):
                yield item
        except aio.AbortError:
            raise
        except XpudError as e:
            await _abort(context, fn.__name__, e)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error in {fn.__name__}; see the daemon log"
            )

    return wrapper


_ONE_MESSAGE = (Message, validate.Undecodable)  # what a server-streaming method's request is


async def _checked(requests):
    async for req in requests:
        validate.check(req)  # raises BadRequest: the stream ends with INVALID_ARGUMENT
        yield req
