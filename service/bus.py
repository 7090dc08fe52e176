"""Wake-ups: tell the scheduler that something changed, instead of leaving it to the next tick.

The scheduler ticks every ``scheduler_interval`` seconds (0.5 by default).
Two kinds of event wake it at once: a job's end (a worker finished a pack) and
a study's change (the API created or cancelled one). Both reach it the way
they can:

- with Redis: a message on the queue's wake channel (:func:`wake_channel`),
  published by RQ workers at each job's end (:func:`announce`) and by the API
  at each study change (:func:`study_changed`); the RQ dispatcher listens with
  a :class:`WakeListener`;
- ``packtune serve``: the scheduler runs in serve's child process; serve
  registers ``service.scheduler_process.SchedulerProcess.wake``, a byte down
  the pipe it already holds to the child (:func:`register`); the embedded
  runner calls the scheduler's wake-up itself when a job ends.

A wake-up that is lost (Redis down, no scheduler listening) costs one tick,
nothing else: the scheduler reads everything from the database.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from packtune.settings import Settings

if TYPE_CHECKING:
    from redis import Redis

log = logging.getLogger(__name__)

_wakers: list[Callable[[], None]] = []
_redis: dict[str, Any] = {}
_lock = threading.Lock()


def wake_channel(queue_name: str) -> str:
    """The Redis channel that wakes the scheduler of queue ``queue_name``."""
    return f"packtune:{queue_name}:wake"


def announce(redis: Redis, queue_name: str, event: str) -> None:
    """Wake the scheduler (if one listens) for ``event`` (a job id, or ``study``); never
    raises."""
    try:
        redis.publish(wake_channel(queue_name), event)
    except Exception as exc:  # Redis down: the scheduler finds out at its next tick
        log.debug("could not announce %s: %s", event, exc)


class WakeListener(threading.Thread):
    """Calls ``on_wake`` for each message on ``channel``; survives Redis restarts."""

    def __init__(self, redis_url: str, channel: str, on_wake: Callable[[], None]) -> None:
        super().__init__(name="packtune-wake", daemon=True)
        self.redis_url, self.channel, self.on_wake = redis_url, channel, on_wake
        self.stop = threading.Event()

    def run(self) -> None:
        from redis import Redis

        while not self.stop.is_set():
            redis = Redis.from_url(self.redis_url, socket_timeout=10)
            pubsub = redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                while not self.stop.is_set():
                    if pubsub.get_message(timeout=1.0) is not None:
                        self.on_wake()
            except Exception as exc:  # e.g. Redis restarting: the ticks go on meanwhile
                log.debug("wake listener: %s; subscribing again", exc)
                self.stop.wait(1.0)
            finally:
                pubsub.close()
                redis.close()


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
        announce(_redis_for(settings.redis_url), settings.queue_name, "study")


def _redis_for(url: str) -> Any:
    with _lock:
        if url not in _redis:
            from redis import Redis

            _redis[url] = Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        return _redis[url]
