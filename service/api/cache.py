"""A micro-cache for the study read endpoints: identical GETs within a second share one answer.

A dashboard polls the same few study endpoints every couple of seconds; with
many viewers, most of those requests ask for what another one computed a
moment ago. :class:`ReadCache` is ASGI middleware that keeps each successful
``GET /api/studies...`` response (keyed by path and query string) for
``ttl`` seconds, and lets concurrent identical requests wait for the one
already being computed instead of all querying the database (single flight).

What may be stale, and for how long: at most ``ttl`` seconds behind what the
scheduler and workers write. A write through this API (any method other than
GET, HEAD or OPTIONS) drops what it may change: for ``POST /api/studies``,
the list of studies (other studies' answers stay: a client creating studies
does not make every dashboard's next reads miss; a new study is not running
yet, so no other study's fair share changes); for any other write,
everything: a write under ``/api/studies/{id}`` (its priority or owner
changed, cancelled, deleted, retried) changes the fair share of device time
that every running study's answer carries. A response computed while a write was in
progress is not kept, so a client reads its own writes. ``ttl`` 0 turns the
cache off (``PACKTUNE_READ_CACHE_SECONDS``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Entry:
    expires: float
    start: Message
    body: bytes


class ReadCache:
    def __init__(
        self,
        app: ASGIApp,
        *,
        ttl: float,
        prefix: str = "/api/studies",
        max_entries: int = 512,
    ) -> None:
        self.app = app
        self.ttl = ttl
        self.prefix = prefix
        self.max_entries = max_entries
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.pending: dict[str, asyncio.Future[Entry | None]] = {}
        self.writes = 0  # writes in progress
        self.generation = 0  # bumped at the start and end of every write

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.ttl <= 0:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in SAFE_METHODS:
            await self._write(scope, receive, send)
            return
        if (
            scope["method"] != "GET"
            or not scope["path"].startswith(self.prefix)
            or scope["path"].endswith("/checkpoint")  # a file: streamed, never kept in memory
        ):
            await self.app(scope, receive, send)
            return
        key = f"{scope['path']}?{scope['query_string'].decode('latin-1')}"
        entry = self.entries.get(key)
        if entry is not None and entry.expires > time.monotonic():
            await _replay(entry, send)
            return
        pending = self.pending.get(key)
        if pending is not None:
            shared = await asyncio.shield(pending)
            if shared is not None:
                await _replay(shared, send)
                return
        await self._compute(key, scope, receive, send)

    async def _write(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.writes += 1
        self.generation += 1
        self._forget(scope["path"])
        try:
            await self.app(scope, receive, send)
        finally:
            self.writes -= 1
            self.generation += 1
            self._forget(scope["path"])

    def _forget(self, path: str) -> None:
        """Drop the answers a write to ``path`` may change (see the module docstring)."""
        if path.rstrip("/") != self.prefix:
            self.entries.clear()
            return
        for key in list(self.entries):
            if key.split("?", 1)[0].rstrip("/") == self.prefix:
                del self.entries[key]

    async def _compute(self, key: str, scope: Scope, receive: Receive, send: Send) -> None:
        future: asyncio.Future[Entry | None] = asyncio.get_running_loop().create_future()
        self.pending[key] = future  # GETs of ``key`` arriving from now on wait for this one
        generation, quiet = self.generation, self.writes == 0
        start: Message | None = None
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        entry: Entry | None = None
        try:
            await self.app(scope, receive, capture)
            if start is not None and start["status"] == 200:
                entry = Entry(time.monotonic() + self.ttl, start, b"".join(chunks))
                if quiet and generation == self.generation:
                    self._keep(key, entry)
        finally:
            # GETs that waited for an answer that failed each compute it again, and each
            # claims ``key`` in turn: leave the latest claim in place for its waiters
            if self.pending.get(key) is future:
                del self.pending[key]
            future.set_result(entry)

    def _keep(self, key: str, entry: Entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


async def _replay(entry: Entry, send: Send) -> None:
    start: dict[str, Any] = dict(entry.start)
    await send(start)
    await send({"type": "http.response.body", "body": entry.body, "more_body": False})
