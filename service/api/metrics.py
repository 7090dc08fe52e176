"""``GET /metrics``: Prometheus text format, computed from the database at scrape time."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from packtune.settings import Settings
from service.prometheus import DatabaseCollector

router = APIRouter(tags=["system"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request) -> Response:
    """Studies, trials and packs by status, pack durations, throughput, worker GPU memory.

    A registry per scrape holds only the database collector: the API process
    counts nothing itself, so every replica answers the same.
    """
    settings: Settings = request.app.state.settings
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        DatabaseCollector(request.app.state.read_sessionmaker, settings.heartbeat_timeout)
    )
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
