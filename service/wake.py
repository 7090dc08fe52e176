"""Wake the scheduler when the API changes a study, instead of leaving it to the next tick.

The scheduler ticks every ``scheduler_interval`` seconds (0.5 by default) and
wakes at once when a job ends. A study POSTed to the API (or cancelled) would
otherwise wait for the next tick: up to half a second before its first pack,
which is a fair part of a small study's wall time on a GPU. After its commit the
API calls :func:`study_changed`, which reaches the scheduler the way it can:

- ``packtune serve``: the scheduler runs in serve's child process; serve
  registers :meth:`service.scheduler_process.SchedulerProcess.wake`, a byte down
  the pipe it already holds to the child (:func:`register`);
- with Redis: a message on the channel on which the scheduler already hears
  workers' job ends (:func:`service.dispatch.done_channel`).

A wake-up that is lost (Redis down, no scheduler listening) costs one tick,
nothing else: the scheduler reads everything from the database.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from service.settings import Settings

log = logging.getLogger(__name__)

_wakers: list[Callable[[], None]] = []
_redis: dict[str, Any] = {}
_lock = threading.Lock()


def register(waker: Callable[[], None]) -> None:
    """Call ``waker`` on every study change from this process (e.g. serve's child's pipe)."""
    with _lock:
        _wakers.append(waker)


def unregister(waker: Callable[[], None]) -> None:
    with _lock:
        if waker in _wakers:
            _wakers.remove(waker)


def study_changed(settings: Settings) -> None:
    """Wake the scheduler (see the module docstring); never raises."""
    with _lock:
        wakers = list(_wakers)
    for waker in wakers:
        try:
            waker()
        except Exception as exc:  # a scheduler gone: it finds the study when it is back
            log.debug("could not wake the scheduler: %s", exc)
    if settings.redis_url:
        from service.dispatch import announce_done

        announce_done(_redis_for(settings.redis_url), settings.queue_name, "study")


def _redis_for(url: str) -> Any:
    with _lock:
        if url not in _redis:
            from redis import Redis

            _redis[url] = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        return _redis[url]
