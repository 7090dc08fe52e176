"""Composition: the pieces a running packtune puts together (used by the CLI's commands).

The one place that chooses a dispatcher implementation: RQ when Redis is
configured, else the embedded runner (a worker-side class, so only this top
layer may import it).
"""

from __future__ import annotations

import threading

from packtune.dispatcher import Dispatcher
from packtune.settings import Settings, get_settings
from service.db import make_engine, session_factory
from service.scheduler import Scheduler


def make_dispatcher(settings: Settings) -> Dispatcher:
    if settings.redis_url:
        from service.rq_dispatcher import RQDispatcher

        return RQDispatcher(settings)
    from worker.embedded import EmbeddedDispatcher

    return EmbeddedDispatcher(settings)


def run_scheduler(
    stop: threading.Event | None = None, dispatcher: Dispatcher | None = None
) -> None:
    """``packtune scheduler`` (and the scheduler process of ``packtune serve``, see
    :mod:`service.scheduler_process`): tick until ``stop`` is set, on an engine of its own
    (when it was a thread of the API process, API requests holding every pooled connection
    stalled it: it waited 30 s per tick under 100 clients). ``dispatcher``: one already
    started (default: the settings' one, started here); it is closed at the end."""
    settings = get_settings()
    engine = make_engine(settings.database_url)
    scheduler = Scheduler(
        settings, session_factory(engine), dispatcher or make_dispatcher(settings)
    )
    try:
        scheduler.dispatcher.start()  # embedded: the runner starts; RQ: hear workers finish
        scheduler.run(stop)
    finally:
        scheduler.close()
        engine.dispose()
