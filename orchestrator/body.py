"""HTTP bodies of the orchestrator: parsing requests, answering, and errors a user can act on.

Called by the handlers (orchestrator/handlers.py) and the middlewares (orchestrator/middlewares.py).
A request body is JSON or msgpack by its Content-Type (gzip already undone by aiohttp, and
counted against `max_request_bytes` after decompression); an answer is msgpack when the
request's Accept names it, JSON otherwise; an error is always JSON {"error": "..."}. The
encodings themselves are decentrl/encoding.py.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from decentrl.encoding import MEDIA_JSON, MEDIA_MSGPACK, MSGPACK_TYPES, EncodingError, encode_model, unpack_msgpack
from orchestrator.limits import retry_after_header

M = TypeVar("M", bound=BaseModel)

# Read as JSON: clients that send JSON without saying so (curl's default, a bare POST).
JSON_TYPES = frozenset({MEDIA_JSON, "text/plain", "application/octet-stream", ""})


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


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}" for item in exc.errors()[:10]
    )


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The body as `model`: 415 for an unknown Content-Type, 400 naming the fields that fail."""
    parsed, _ = await parse_body_with_raw(request, model)
    return parsed


async def parse_body_with_raw(request: web.Request, model: type[M]) -> tuple[M, Any]:
    """`parse_body`, plus the decoded msgpack object (None for a JSON body): its typed arrays keep
    the bytes they came in, for the rollouts handler to journal and serve as they are
    (orchestrator/codec.py, `packed_arrays`)."""
    media = request.content_type
    msgpack = media in MSGPACK_TYPES
    if not msgpack and media not in JSON_TYPES and not media.endswith("+json"):
        raise error(
            web.HTTPUnsupportedMediaType,
            f"Content-Type {media!r} is not supported; send {MEDIA_JSON} or {MEDIA_MSGPACK} (optionally gzip-encoded)",
        )
    body = await request.read()  # 413 above client_max_size, counted after decompression
    try:
        if msgpack:
            decoded = unpack_msgpack(body)
            return model.model_validate(decoded), decoded
        return model.model_validate_json(body), None
    except EncodingError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: body: {exc}") from None
    except ValidationError as exc:
        raise error(web.HTTPBadRequest, f"invalid {model.__name__}: {_problems(exc)}") from None
