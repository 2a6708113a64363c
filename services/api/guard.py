"""What stands between a request and the api's routes: the bearer token, the body cap, and error
responses that never echo more than a short excerpt of the input.

``guard(app, settings)`` installs all of it. The token and the cap are plain ASGI middleware, so
they apply before FastAPI reads or parses anything: a client without the token cannot make the api
buffer a body, and a body over the cap is refused before it is parsed.
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Annotated, Any

from fastapi import FastAPI, Path, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api.config import ApiSettings

JobId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=200,
        pattern=r"^[^{}]+$",
        description="The job id, e.g. addition-1a2b3c4d (no braces: they are its keys' hash tag).",
    ),
]
"""A job id in a path: what no job can have (braces, nothing, 200+ characters) is a 422."""

OPEN_PATHS = frozenset({"/healthz", "/metrics", "/"})
"""Paths served without the token (probes, Prometheus, the dashboard's page)."""
OPEN_PREFIXES = ("/dashboard/",)
"""Path prefixes served without the token: the dashboard's static assets (no data; the page asks for
the token and sends it with each api call)."""
EXCERPT_CHARS = 200
"""Most characters of a client's input that an error response repeats."""
SECURITY_SCHEME = "bearer"


class ErrorBody(BaseModel):
    """An error other than a validation error."""

    detail: str
    """What went wrong."""


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for ``codes`` (each with ErrorBody; 422 keeps FastAPI's own model)."""
    described = {
        400: "The body could not be read as JSON text.",
        401: "Missing or wrong `Authorization: Bearer <token>` (when VERST_API_TOKEN is set).",
        404: "No such job.",
        409: "The job already finished.",
        413: "The request body is larger than VERST_API_MAX_BODY_BYTES.",
        503: "The job store (Redis) is unavailable; try again (see Retry-After).",
    }
    return {code: {"model": ErrorBody, "description": described[code]} for code in codes}


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate written as its escape, so it encodes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def excerpt(value: Any) -> Any:
    """A value of the client's to repeat in an error: strings cut to EXCERPT_CHARS, anything
    whose JSON is longer than that replaced by the start of its JSON text."""
    if isinstance(value, str):
        if len(value) > EXCERPT_CHARS:
            value = f"{value[:EXCERPT_CHARS]}… ({len(value)} characters)"
        return clean_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf or nan
    if value is None or isinstance(value, bool | int | float):
        return value
    try:
        text = json.dumps(jsonable_encoder(value), ensure_ascii=True, allow_nan=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if len(text) <= EXCERPT_CHARS:
        return _cleaned(json.loads(text))
    return f"{text[:EXCERPT_CHARS]}… ({len(text)} characters of JSON)"


def _cleaned(value: Any) -> Any:
    """A copy of parsed JSON with every string (keys too) passed through clean_text."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [_cleaned(item) for item in value]
    if isinstance(value, dict):
        return {clean_text(key): _cleaned(item) for key, item in value.items()}
    return value


def validation_detail(errors: Any) -> list[dict[str, Any]]:
    """FastAPI's 422 ``detail`` list with each input, location part and context cut to an excerpt."""
    detail = []
    for error in errors:
        item: dict[str, Any] = {
            "type": error.get("type", ""),
            "loc": [excerpt(part) for part in error.get("loc", ())],
            "msg": excerpt(str(error.get("msg", ""))),
            "input": excerpt(error.get("input")),
        }
        if error.get("ctx"):
            item["ctx"] = {str(key): excerpt(str(value)) for key, value in error["ctx"].items()}
        detail.append(item)
    return detail


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": validation_detail(exc.errors())}, 422)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    body = {"detail": excerpt(exc.detail) if isinstance(exc.detail, str) else exc.detail}
    return JSONResponse(body, exc.status_code, headers=exc.headers)


Headers = list[tuple[bytes, bytes]]


async def _reply(send: Send, code: int, detail: str, headers: Headers | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": code, "headers": [*head, *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class TokenMiddleware:
    """401 for any path but OPEN_PATHS without ``Authorization: Bearer <token>`` (compared in
    constant time)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, credentials = given.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self._token):
            await self.app(scope, receive, send)
            return
        what = "wrong bearer token" if given else "this api needs `Authorization: Bearer <token>`"
        await _reply(send, 401, what, [(b"www-authenticate", b"Bearer")])


class BodyLimitMiddleware:
    """413 for a request body over ``limit`` bytes, by its Content-Length or as it arrives; the
    body (at most ``limit`` bytes) is read once and handed on."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_long = f"the request body is larger than {self.limit} bytes (VERST_API_MAX_BODY_BYTES)"
        for name, value in scope["headers"]:
            if name == b"content-length" and (not value.isdigit() or int(value) > self.limit):
                await _reply(send, 413, too_long)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await _reply(send, 413, too_long)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The schema, with the bearer scheme on every operation but OPEN_PATHS."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes[SECURITY_SCHEME] = {
            "type": "http",
            "scheme": "bearer",
            "description": "VERST_API_TOKEN; required when the api sets one.",
        }
        for path, operations in schema["paths"].items():
            if path not in OPEN_PATHS:
                for operation in operations.values():
                    operation["security"] = [{SECURITY_SCHEME: []}]
        app.openapi_schema = schema
    return app.openapi_schema


def guard(app: FastAPI, settings: ApiSettings) -> None:
    """Install the error handlers, the body cap and (when VERST_API_TOKEN is set) the token check."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.token is not None:  # added last, so it runs first
        app.add_middleware(TokenMiddleware, token=settings.token.get_secret_value())
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
