"""Composition: the pieces a running packtune puts together (used by the CLI's commands).

The one place that chooses a dispatcher implementation: RQ when Redis is
configured, else the embedded runner (a worker-side class, so only this top
layer may import it).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import threading

from packtune.dispatcher import Dispatcher
from packtune.settings import Settings, get_settings


def make_dispatcher(settings: Settings) -> Dispatcher:
    """The settings' dispatcher, not started. Cheap to import: ``packtune run`` starts the
    embedded runner (seconds of imports in the child) before its own heavier imports."""
    if settings.redis_url:
        from service.rq_dispatcher import RQDispatcher

        return RQDispatcher(settings)
    from worker.embedded import EmbeddedDispatcher

    return EmbeddedDispatcher(settings)


def preload_sampler() -> threading.Thread:
    """Import the model-based sampler's library (Optuna, ~0.2 s) in a background thread, so
    that a study's first model-based draw does not pay it inside a scheduler tick, on the
    study's critical path (the scheduler waits for its runner's start meanwhile anyway).
    Returns the thread."""

    def load() -> None:
        with contextlib.suppress(ImportError):
            importlib.import_module("optuna")

    thread = threading.Thread(target=load, name="packtune-preload", daemon=True)
    thread.start()
    return thread


def settle_heap() -> None:
    """Collect, then freeze what is alive (imports, settings, the engine: what lives as long
    as the process) out of the collector's way, as the API does at its start. A full
    collection otherwise walks all of it in the middle of a tick: in one pass of bench d
    (20 studies, PostgreSQL) 16 full collections at 50-90 ms each, 0.88 s of collections in
    all inside its ticks; frozen, 20-40 ms each, 0.42 s (AMD EPYC, 2 cores)."""
    gc.collect()
    gc.freeze()


def run_scheduler(
    stop: threading.Event | None = None, dispatcher: Dispatcher | None = None
) -> None:
    """``packtune scheduler`` (and the scheduler process of ``packtune serve``, see
    :mod:`service.scheduler_process`): tick until ``stop`` is set, on an engine of its own
    (when it was a thread of the API process, API requests holding every pooled connection
    stalled it: it waited 30 s per tick under 100 clients). ``dispatcher``: one already
    started (default: the settings' one, started here); it is closed at the end."""
    from service.db import make_engine, session_factory
    from service.scheduler import Scheduler

    settings = get_settings()
    dispatcher = dispatcher or make_dispatcher(settings)
    try:
        engine = make_engine(settings.database_url)
    except BaseException:
        dispatcher.close()  # a runner already started would hold its parent's exit up
        raise
    scheduler = Scheduler(settings, session_factory(engine), dispatcher)
    loading = preload_sampler()
    try:
        scheduler.dispatcher.start()  # embedded: the runner starts; RQ: hear workers finish
        loading.join(timeout=30)  # once, at the start: Optuna's objects are frozen too
        settle_heap()
        scheduler.run(stop)
    finally:
        scheduler.close()
        engine.dispose()
