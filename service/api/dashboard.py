"""``GET /``: the dashboard page, and ``GET /static/{name}``: its own assets.

Everything the page needs ships in ``service/api/static`` (no CDN, no
third-party scripts), so it works on a host without internet access. The page
reads the JSON endpoints under ``/api`` and polls them while a study runs.
Only files present in that folder at start-up are served; any other name is 404.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# Revalidate on every load: a new release's assets are picked up at once.
HEADERS = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


def _assets() -> dict[str, Path]:
    return {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in MEDIA_TYPES}


ASSETS = _assets()


@router.get("/")
def index() -> FileResponse:
    """The single-page dashboard (studies list and study pages, routed by ``#/...``)."""
    return _file("index.html")


@router.get("/static/{name}")
def asset(name: str) -> FileResponse:
    return _file(name)


def _file(name: str) -> FileResponse:
    path = ASSETS.get(name)
    if path is None:
        raise HTTPException(status_code=404, detail=f"no asset named {name!r}")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)
