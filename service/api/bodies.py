"""JSON bodies read by :func:`packtune.spec_text.loads_json`: an integer too long to read
is a 422 naming where it is, like any bad field, not a 400 for the whole body.

FastAPI reads a body with ``Request.json()`` and answers 400 to any error but a
``JSONDecodeError`` or an ``HTTPException``, which it lets through: so the error is an
``HTTPException`` whose detail is a validation error's (see :mod:`service.api.app`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute

from packtune.errors import SpecError
from packtune.spec_text import loads_json


def spec_error_detail(error: SpecError) -> dict[str, Any]:
    """A ``SpecError`` as an entry of a 422's ``detail``, as FastAPI writes its own."""
    return {"loc": ["body", *error.field.split(".")], "msg": error.message, "type": "value_error"}


class _Request(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads_json(await self.body())
            except SpecError as exc:
                raise HTTPException(422, detail=[spec_error_detail(exc)]) from None
        return self._json


class JSONRoute(APIRoute):
    """A route whose body is read by :func:`~packtune.spec_text.loads_json`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_Request(request.scope, request.receive))

        return route
