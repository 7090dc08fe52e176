"""The scheduler of ``packtune serve`` in a child process, and stopping a scheduler on signals.

``packtune serve`` answers HTTP requests and, unless ``--no-scheduler``, runs
the scheduler loop (and through it the embedded runner) as well. The loop runs
in a child process rather than a thread of the API process: its ticks are
Python work (SQLAlchemy statements, ORM rows) that held the API process's GIL
for ~40% of the time it was held at all under 100 dashboard clients while small
studies trained, and every request thread coming back from a query waited for
it.

The child is started with ``spawn`` (the API process has threads and a running
event loop; nothing of it should be forked) and stops, finishing its tick,
releasing the scheduler lease and stopping the runner, when

- the parent stops it (:meth:`SchedulerProcess.stop`: ``serve`` exiting after
  Ctrl-C, SIGTERM or an error),
- it gets SIGTERM or SIGINT itself (Ctrl-C reaches the whole process group), or
- the parent is gone without a word (SIGKILL): the pipe between them is closed
  by the kernel, and the child sees the end of it.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from multiprocessing.connection import Connection
from types import FrameType

log = logging.getLogger(__name__)


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` instead of ending the process (main thread only),
    so the scheduler finishes its tick and releases its lease."""

    def handle(signum: int, _: FrameType | None) -> None:
        log.info("scheduler: %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


class SchedulerProcess:
    """``run_scheduler`` in a spawned child process, stopped through a pipe."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._send_lock = threading.Lock()  # the API's threads wake it concurrently
        self.process = ctx.Process(target=_child, args=(self._reader,), name="packtune-scheduler")

    def start(self) -> None:
        self.process.start()
        self._reader.close()  # the child's end; the parent keeps only the writing one

    def wake(self) -> None:
        """Have the scheduler tick now (a study was created or cancelled); never blocks long:
        a byte down the pipe, which the child reads as it comes."""
        with self._send_lock:
            if not self._writer.closed:
                self._writer.send_bytes(b"w")

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the child to stop and wait for it; killed if it has not stopped in ``timeout``
        seconds (its lease then expires on its own, and its runner exits with it)."""
        if self.process.pid is None:
            return  # never started
        with self._send_lock:
            self._writer.close()  # the child sees the end of the pipe
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("scheduler process did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join()


def _child(stop_pipe: Connection) -> None:
    """The child: the scheduler loop until the parent stops it, a signal, or the parent is gone."""
    from packtune.settings import get_settings
    from service.runtime import make_dispatcher, run_scheduler

    stop = threading.Event()
    stop_on_signals(stop)
    settings = get_settings()
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # the embedded runner's start (spawn, torch: seconds) overlaps the scheduler's imports
    dispatcher = make_dispatcher(settings)

    def watch_parent() -> None:
        """A byte from the parent: tick now (``wake``); the pipe's end (the parent closed it,
        or is gone): stop."""
        while True:
            try:
                stop_pipe.recv_bytes()
            except (EOFError, OSError):
                stop.set()
                return
            if dispatcher.notify is not None:  # the scheduler's, once it is built
                dispatcher.notify()

    threading.Thread(target=watch_parent, name="packtune-parent-watch", daemon=True).start()
    dispatcher.start()
    run_scheduler(stop, dispatcher)
