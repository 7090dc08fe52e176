"""Dependencies the routes share: a database session, the settings, the write guard."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

import anyio
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from packtune.settings import Settings
from packtune.tuning import DB_SLOTS
from service.db import session_scope


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def db_slot(request: Request) -> AsyncIterator[None]:
    """Wait, in the event loop and holding no thread, for one of :data:`DB_SLOTS`.

    Without it, 100 concurrent clients deadlocked the API until the pool's 30 s
    timeout: every threadpool thread waited for a pooled connection, while the
    requests holding the connections waited for a thread to validate their
    response (FastAPI does that for sync routes in the threadpool, inside the
    session's scope). With at most ``DB_SLOTS`` sessions open, a thread always
    finds a connection.
    """
    slots: anyio.Semaphore | None = getattr(request.app.state, "db_slots", None)
    if slots is None:
        slots = request.app.state.db_slots = anyio.Semaphore(DB_SLOTS)
    async with slots:
        yield


def get_session(
    request: Request, _slot: Annotated[None, Depends(db_slot, scope="function")]
) -> Iterator[Session]:
    """One session per request, committed when the route returns, rolled back if it raises.

    Used with ``scope="function"`` so the commit happens before the response
    is sent: a client that sees 201 can read what it created. GET and HEAD
    requests only read: their sessions come from :func:`service.db.read_only`.
    """
    factory: sessionmaker[Session] = request.app.state.sessionmaker
    if request.method in ("GET", "HEAD"):
        factory = request.app.state.read_sessionmaker
    with session_scope(factory) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]

_bearer = HTTPBearer(auto_error=False, description="Set when PACKTUNE_API_TOKEN is configured.")


def require_token(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Writes need ``Authorization: Bearer <token>`` when ``api_token`` is set; reads do not."""
    if settings.api_token is None:
        return
    expected = settings.api_token.get_secret_value().encode()
    given = credentials.credentials.encode() if credentials is not None else b""
    if not secrets.compare_digest(given, expected):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="missing or wrong bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )
