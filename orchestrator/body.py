"""HTTP bodies of the orchestrator: parsing requests, answering, and errors a user can act on.

Called by the handlers (orchestrator/handlers.py, score_handlers.py, dashboard.py) and the
middlewares (orchestrator/middlewares.py); also the query parameters they read and who the caller is.
A request body is JSON or msgpack by its Content-Type, optionally gzip- or deflate-compressed
(Content-Encoding); an answer is msgpack when the request's Accept names it, JSON otherwise; an
error is always JSON {"error": "..."}. The encodings themselves are decentrl/api/encoding.py.

Bodies are read here, not by aiohttp's own decompression (create_app turns it off): a body that
does not decompress, or is cut short, must be a 400 saying so (aiohttp's answered 500, or took a
gzip stream without its end), an encoding we do not speak a 415 (RFC 9110), and the decompressed
size is bounded as it is produced (`max_request_bytes`: 413), so a small bomb stays small; a
Content-Length over the limit is answered 413 before the body is read. The whole body must arrive
within `body_timeout_s` (408); the rollout handler reads it before it takes a place in flight.
"""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from decentrl.api.encoding import MEDIA_JSON, MEDIA_MSGPACK, MSGPACK_TYPES, EncodingError, encode_model, unpack_msgpack
from decentrl.api.wire import WORKER_ID, problems
from decentrl.config.orchestrator import OrchestratorConfig
from orchestrator.auth import IDENTITY
from orchestrator.limits import retry_after_header

M = TypeVar("M", bound=BaseModel)

# Read as JSON: clients that send JSON without saying so (curl's default, a bare POST).
JSON_TYPES = frozenset({MEDIA_JSON, "text/plain", "application/octet-stream", ""})
# Content-Encoding -> zlib's wbits: gzip (with its header and trailer), deflate (RFC 9110: the
# zlib format; raw deflate is not accepted).
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# [orchestrator], set by create_app: its max_request_bytes and body_timeout_s bound every body.
OPTIONS = web.AppKey("options", OrchestratorConfig)


def error(
    kind: type[web.HTTPException], message: str, *, retry_after: float | None = None
) -> web.HTTPException:
    """An HTTP error with a JSON body saying what to fix (and when to retry, for 429 and 503)."""
    headers = {"Retry-After": retry_after_header(retry_after)} if retry_after is not None else None
    return kind(text=json.dumps({"error": message}), content_type=MEDIA_JSON, headers=headers)


def wants_msgpack(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return any(media in accept for media in MSGPACK_TYPES)


def respond(request: web.Request, model: BaseModel, status: int = 200) -> web.Response:
    if wants_msgpack(request):
        return web.Response(body=encode_model(model, MEDIA_MSGPACK), status=status, content_type=MEDIA_MSGPACK)
    return web.Response(body=model.model_dump_json().encode(), status=status, content_type=MEDIA_JSON)


async def read_body(request: web.Request, *, limit: int, timeout_s: float) -> bytes:
    """The request's body, decompressed by its Content-Encoding, within `timeout_s` and `limit` bytes
    (compressed or not); how it fails is the module's docstring."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ENCODINGS and encoding not in ("identity", ""):
        raise error(
            web.HTTPUnsupportedMediaType,
            f"Content-Encoding {encoding[:40]!r} is not supported; send gzip, deflate or none",
        )
    if (declared := request.content_length) is not None and declared > limit:
        # Answered before a byte of the body is read: waiting for a body it will refuse would hold
        # the request until body_timeout_s (a client announcing 10^12 bytes and sending 2); aiohttp
        # then discards what still comes for at most its lingering time and closes the connection.
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=declared, content_type=MEDIA_JSON,
            text=json.dumps({"error": f"Content-Length {declared} is over {limit} bytes, the limit "
                             "(orchestrator.max_request_bytes); send less per request"}),
        )
    try:
        raw = await asyncio.wait_for(request.read(), timeout=timeout_s)  # 413 above client_max_size
    except TimeoutError:
        raise error(
            web.HTTPRequestTimeout,
            f"the body did not arrive within {timeout_s:g} s (orchestrator.body_timeout_s); send it faster or smaller",
        ) from None
    if encoding not in ENCODINGS:
        return raw
    inflate = zlib.decompressobj(ENCODINGS[encoding])
    try:
        body = inflate.decompress(raw, limit + 1)  # at most one byte past the limit is ever produced
    except zlib.error as exc:
        raise error(web.HTTPBadRequest, f"the body is not valid {encoding} ({exc}); compress it or drop Content-Encoding") from None
    if len(body) > limit:
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=len(body), content_type=MEDIA_JSON,
            text=json.dumps({"error": f"the body decompresses to more than {limit} bytes; "
                             "the limit is orchestrator.max_request_bytes"}),
        )
    if not inflate.eof or inflate.unused_data:
        raise error(web.HTTPBadRequest, f"the {encoding} body is cut short or has bytes after its end; send it whole")
    return body


async def parse_body(request: web.Request, model: type[M], context: dict[str, Any] | None = None) -> M:
    """The body as `model`: 415 for an unknown Content-Type, 400 naming the fields that fail.
    `context`: the run's own bounds the model's validators read (decentrl/api/wire.py `MASK_IDS`)."""
    media = request.content_type
    msgpack = media in MSGPACK_TYPES
    if not msgpack and media not in JSON_TYPES and not media.endswith("+json"):
        raise error(
            web.HTTPUnsupportedMediaType,
            f"Content-Type {media!r} is not supported; send {MEDIA_JSON} or {MEDIA_MSGPACK} (optionally gzip-encoded)",
        )
    options = request.app[OPTIONS]
    body = await read_body(request, limit=options.max_request_bytes, timeout_s=options.body_timeout_s)
    try:
        if msgpack:
            return model.model_validate(unpack_msgpack(body), context=context)
        return model.model_validate_json(body, context=context)
    except EncodingError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: body: {exc}") from None
    except ValidationError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: {problems(exc)}") from None


# -- query parameters and the caller ------------------------------------------------------

# Query numbers are written as JSON writes them, without a sign: int() and float() would also take
# " 5", "+5", "5_0", other scripts' digits, "nan" and "inf", none of which a client means.
INTEGER = re.compile(r"[0-9]{1,32}")
NUMBER = re.compile(r"(?=.{1,32}$)[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def query_text(request: web.Request, name: str) -> str | None:
    """Query parameter `name` given once, None without it; 400 when it is given twice."""
    values = request.query.getall(name, [])
    if len(values) > 1:
        raise error(web.HTTPBadRequest, f"query parameter {name} is given {len(values)} times; give it once")
    return values[0] if values else None


def only_query(request: web.Request, *names: str) -> None:
    """400 for a query parameter the route does not take: a misspelt one must not be ignored."""
    if unknown := sorted(set(request.query) - set(names)):
        raise error(web.HTTPBadRequest, f"unknown query parameter {unknown[0][:40]!r}; this route takes {', '.join(names)}")


def query_int_or_none(request: web.Request, name: str, *, high: int) -> int | None:
    """Integer query parameter `name` in [0, high]; None without it."""
    text = query_text(request, name)
    if text is None:
        return None
    if not INTEGER.fullmatch(text):
        raise error(web.HTTPBadRequest, f"query parameter {name} must be an integer >= 0 (decimal digits), got {text[:40]!r}")
    if (value := int(text)) > high:
        raise error(web.HTTPBadRequest, f"query parameter {name} must be between 0 and {high}, got {value}")
    return value


def query_int(request: web.Request, name: str, *, high: int) -> int:
    """Integer query parameter `name` in [0, high], required."""
    value = query_int_or_none(request, name, high=high)
    if value is None:
        raise error(web.HTTPBadRequest, f"query parameter {name} (an integer >= 0) is required")
    return value


def query_seconds(request: web.Request, name: str, *, high: float, default: float) -> float:
    """Query parameter `name`: seconds in [0, high], a number as JSON writes it ("30", "2.5"); `default` without it."""
    text = query_text(request, name)
    if text is None:
        return default
    if not NUMBER.fullmatch(text):
        raise error(web.HTTPBadRequest, f"query parameter {name} must be a number of seconds >= 0 (e.g. 30 or 2.5), got {text[:40]!r}")
    if (value := float(text)) > high:  # "1e999" is inf: above
        raise error(web.HTTPBadRequest, f"query parameter {name} must be between 0 and {high:g} seconds, got {text}")
    return value


def holder_of(request: web.Request, worker_id: str) -> str:
    """Who holds a lease: the caller's token name and its worker id ("alice/w0")."""
    return f"{request[IDENTITY].name}/{worker_id}"


def query_id(request: web.Request, name: str) -> str:
    """The lease holder named by query parameter `name` (worker_id, scorer_id) and the caller's token."""
    worker_id = request.query.get(name, "")
    if not re.fullmatch(WORKER_ID, worker_id):
        raise error(web.HTTPBadRequest, f"query parameter {name} is required and must match {WORKER_ID}")
    return holder_of(request, worker_id)
