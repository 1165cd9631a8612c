"""The OpenAPI 3.1 description of the orchestrator's routes (GET /openapi.json).

Built from the same route table the app registers (`orchestrator.app.ROUTES`) and from the
pydantic models' JSON schemas, so it cannot drift from what the handlers validate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from decentrl.api.encoding import MEDIA_JSON, MEDIA_MSGPACK
from decentrl.api.wire import ErrorBody

REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "query" or "path"
    schema: dict[str, Any]
    description: str
    required: bool = True


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    summary: str
    roles: tuple[str, ...] | None  # None: no token needed
    body: type[BaseModel] | None = None
    params: tuple[Param, ...] = ()
    answers: dict[int, type[BaseModel] | str | None] = field(default_factory=dict)  # status -> model, media type or empty
    errors: tuple[int, ...] = ()
    msgpack: bool = False  # body and answer may also be application/msgpack
    tag: str = "run"


ERROR_TEXT = {
    400: "Malformed: the message names the field and what is allowed.",
    401: "No bearer token, or an unknown (or revoked) one.",
    403: "The token's role may not call this route, or the lease is another worker's.",
    404: "No such lease, token or route.",
    408: "The body did not arrive within orchestrator.body_timeout_s.",
    409: "Conflict: another run, a closed lease, an existing token name, a version not in the store.",
    413: "Body over orchestrator.max_request_bytes (after decompression).",
    415: "Content-Type is neither JSON nor msgpack, or Content-Encoding is neither gzip nor deflate.",
    429: "This token is over its rate limit: retry after Retry-After seconds.",
    503: "Overloaded (too many requests in flight, buffer full) or the journal failed: retry after Retry-After.",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 1}}}


def _content(ref: dict[str, Any], msgpack: bool) -> dict[str, Any]:
    return {media: {"schema": ref} for media in ((MEDIA_JSON, MEDIA_MSGPACK) if msgpack else (MEDIA_JSON,))}


def build_openapi(routes: list[Endpoint], *, title: str, version: str, description: str) -> dict[str, Any]:
    models: set[tuple[type[BaseModel], str]] = {(ErrorBody, "serialization")}
    for route in routes:
        if route.body is not None:
            models.add((route.body, "validation"))
        for answer in route.answers.values():
            if isinstance(answer, type):
                models.add((answer, "serialization"))
    keys, top = models_json_schema(sorted(models, key=lambda m: (m[0].__name__, m[1])), ref_template=REF)
    error_ref = keys[(ErrorBody, "serialization")]
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": f"{route.method.lower()}_{route.path.strip('/').replace('/', '_').replace('{', '').replace('}', '') or 'root'}",
            "tags": [route.tag],
            "responses": {},
            "security": [{"bearer": []}] if route.roles is not None else [],
        }
        if route.roles is not None:
            operation["description"] = f"Roles: {', '.join(route.roles)}."
        if route.params:
            operation["parameters"] = [
                {"name": p.name, "in": p.where, "required": p.required or p.where == "path",
                 "description": p.description, "schema": p.schema}
                for p in route.params
            ]
        if route.body is not None:
            operation["requestBody"] = {"required": True, "content": _content(keys[(route.body, "validation")], route.msgpack)}
        for status, answer in route.answers.items():
            if isinstance(answer, type):
                response = {"description": answer.__doc__.strip().splitlines()[0] if answer.__doc__ else answer.__name__,
                            "content": _content(keys[(answer, "serialization")], route.msgpack)}
            elif isinstance(answer, str):
                body_schema = {"type": "object"} if answer == MEDIA_JSON else {"type": "string"}
                response = {"description": answer.split(";")[0], "content": {answer: {"schema": body_schema}}}
            else:
                response = {"description": "No content."}
            operation["responses"][str(status)] = response
        errors = set(route.errors) | {429, 503} | ({401, 403} if route.roles is not None else set())
        if route.body is not None:
            errors |= {400, 408, 413, 415}
        if route.params:
            errors.add(400)
        for status in sorted(errors):
            response = {"description": ERROR_TEXT[status], "content": {MEDIA_JSON: {"schema": error_ref}}}
            if status in (429, 503):
                response["headers"] = RETRY_AFTER
            operation["responses"][str(status)] = response
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "A token from the tokens file."}},
        },
    }
