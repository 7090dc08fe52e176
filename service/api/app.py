"""The FastAPI application: routers, error mapping, request body limit.

``create_app(settings)`` builds an app; ``service.api.app:app`` is one built
from the environment on first access (so importing this module has no side
effects). The app serves requests only: the scheduler runs elsewhere (``packtune
serve`` starts it beside uvicorn). Nothing here imports torch.

Errors, all as ``{"detail": ...}``:

- :class:`~packtune.errors.PacktuneError` subclasses -> their ``status_code``;
  a :class:`~packtune.errors.SpecError` -> 422 with ``detail`` a list like
  FastAPI's own, ``[{"loc": ["body", "hyperband", "eta"], "msg": ..., "type":
  "value_error"}]``, so a client sees which field is wrong;
- request validation -> 422 (spec errors raised inside the body's validators
  are reported the same way as above);
- a body that is not JSON -> 422, not UTF-8 -> 400, over :data:`MAX_BODY_BYTES` -> 413;
  an integer in it too long to read -> 422 naming its field (:mod:`service.api.bodies`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from sqlalchemy import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from packtune.errors import PacktuneError, SpecError, StoreUnavailable
from packtune.settings import Settings, get_settings
from service.api import checks, dashboard, metrics, routes, system
from service.api.bodies import spec_error_detail
from service.api.cache import ReadCache
from service.db import get_sessionmaker, make_engine, read_only, session_factory

log = logging.getLogger(__name__)
#: what a client is told when the database cannot be reached (the log has the details)
UNAVAILABLE = "the database is unavailable; try again shortly"
MAX_BODY_BYTES = 1 << 20


def create_app(settings: Settings | None = None) -> FastAPI:
    """An app over the database of ``settings`` (default: the environment's settings).

    Without ``settings`` the process-wide session factory is used; with them
    the app owns an engine of its own, disposed when the app shuts down.
    """
    owned: Engine | None = None
    if settings is None:
        settings = get_settings()
        factory = get_sessionmaker()
    else:
        owned = make_engine(settings.database_url)
        factory = session_factory(owned)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Everything imported and built so far (~110,000 objects: FastAPI, pydantic,
        # SQLAlchemy) lives as long as the process. Left to the collector, each full
        # collection walked all of it: 80-100 ms on a 2-core VM, during which no request
        # moved, three times in three minutes under load, which was the p99. Frozen, a full
        # collection walks only what requests left behind (0.5 ms measured). Collected
        # first, so that no garbage is frozen with it.
        gc.collect()
        gc.freeze()
        yield
        if owned is not None:
            owned.dispose()

    # /docs and /redoc from assets shipped in fastapi-offline: no CDN (the default pages
    # render blank without the internet)
    app = FastAPIOffline(
        title="packtune",
        summary="Pack-aware hyperparameter tuning: Hyperband whose trials share a GPU.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.sessionmaker = factory
    app.state.read_sessionmaker = read_only(factory)
    app.include_router(routes.writes)
    app.include_router(routes.router)
    app.include_router(checks.writes)
    app.include_router(checks.router)
    app.include_router(system.router)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    app.add_exception_handler(PacktuneError, _packtune_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, timeout=settings.body_timeout)
    app.add_middleware(ReadCache, ttl=settings.read_cache_seconds)
    if settings.api_token is not None:  # outermost: before any byte of a body is read
        app.add_middleware(WritesNeedToken, token=settings.api_token.get_secret_value())
    return app


async def _packtune_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PacktuneError)
    if isinstance(exc, SpecError):
        return JSONResponse(status_code=422, content={"detail": [spec_error_detail(exc)]})
    if isinstance(exc, StoreUnavailable):  # the driver's text names the database's host
        log.warning("%s", exc)
        return JSONResponse(status_code=exc.status_code, content={"detail": UNAVAILABLE})
    return JSONResponse(status_code=exc.status_code, content={"detail": str(exc)})


def _plain(value: Any) -> Any:
    """A JSON-safe copy of an error's context value (no exceptions, no NaN)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    detail = []
    for error in exc.errors():
        ctx = error.get("ctx") or {}
        if isinstance(ctx.get("error"), SpecError):
            detail.append(spec_error_detail(ctx["error"]))
            continue
        entry: dict[str, Any] = {
            "loc": [_plain(part) for part in error["loc"]],
            "msg": error["msg"],
            "type": error["type"],
        }
        if ctx:
            entry["ctx"] = {key: _plain(value) for key, value in ctx.items()}
        detail.append(entry)  # the input is not echoed: it may be large or not JSON-safe
    return JSONResponse(status_code=422, content={"detail": detail})


class WritesNeedToken:
    """With a token set, a request that may write (any method but GET, HEAD and OPTIONS)
    without ``Authorization: Bearer <token>`` is answered 401 before its body is read: a
    client without the token learns nothing of how its body would have been judged. (The
    routes check the token again, and declare it in the OpenAPI document.)"""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.expected = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given, self.expected):
                response = JSONResponse(
                    status_code=401, content={"detail": "missing or wrong bearer token"},
                    headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Answer 413 to a request whose body is over ``max_bytes``.

    The declared ``Content-Length`` is checked first; a body sent without one
    (chunked) is read up to the limit and then replayed to the app.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = body_done = False

        async def timed() -> Message:
            """Each part of the body within the timeout; later calls (a server telling of a
            disconnect while the response streams) wait as long as they need."""
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise _SlowBody from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._limited(scope, timed, sending)
        except _SlowBody:
            if not started:
                await _reject(send, 408, f"request body not received within {self.timeout:g} s")

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reject(send, 400, "invalid Content-Length header")
                return
            if int(declared) > self.max_bytes:
                await _reject(send, 413, f"request body is over {self.max_bytes} bytes")
                return
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _reject(send, 413, f"request body is over {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class _SlowBody(BaseException):
    """A part of the request body did not arrive in time. A BaseException, so that the
    framework's own handling of body errors (a 400 for any Exception while reading the
    body) lets it through to :class:`BodyLimit`, which answers 408."""


async def _reject(send: Send, status: int, detail: str) -> None:
    response = JSONResponse(status_code=status, content={"detail": detail})
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


app: FastAPI  # bound on first access by __getattr__ below


def __getattr__(name: str) -> Any:
    # ``service.api.app:app`` for uvicorn without the factory flag: built on first use.
    if name == "app":
        global app
        app = create_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
