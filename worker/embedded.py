"""The embedded dispatcher: packs run in child processes of the scheduler's, no Redis.

This is what ``packtune run`` and a laptop's ``packtune serve`` use. A child
process (a *runner*) runs packs one after another (``worker.jobs.run_pack``, the
same job RQ workers run); ``embedded_runners`` of them on a CPU, each a worker
row of its own (``embedded@host``, ``embedded-2@host``...) taking the next pack
as it is free, as RQ workers take jobs. They are started with ``spawn`` so the parent (API +
scheduler) never loads torch or CUDA; a crashed child is replaced, and a child
whose parent is gone (killed, or ended by a signal that skips its clean-up)
exits instead of lingering as an orphan. :meth:`EmbeddedDispatcher.start`
starts it ahead of the first pack, so that its imports (torch: ~1.5 s on a
CPU, CUDA start-up several more on a GPU) overlap the parent's own start.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packtune.dispatcher import JobState
from packtune.errors import DeviceUnavailable
from packtune.settings import ENV_PREFIX, WORKER_NAME_ENV, Settings, default_torch_threads
from worker.gpu import cuda_device_readings, gpu_readings

THREADS_ENV = f"{ENV_PREFIX}TORCH_THREADS"

log = logging.getLogger(__name__)


def _init_runner(
    parent: int, nice: int, nudges: Any = None, names: Any = None, threads: int | None = None
) -> None:
    """In the child, first thing: train at a lower CPU priority (``nice``: on a laptop the
    API, the dashboard and the scheduler share the cores with training), exit once
    ``parent`` is gone (the child is re-parented), and let ``nudges`` (an event the
    scheduler sets, :meth:`EmbeddedDispatcher.nudge`) wake a running pack's watch. Of
    several runners, each takes its worker name from ``names`` (a queue) and trains with
    ``threads`` torch threads.

    Without it, ``packtune serve`` ended by SIGTERM (uvicorn re-raises the signal, so
    no clean-up runs) or SIGKILL left its runner idle for ever, holding ~400 MB.
    """

    # Ctrl-C reaches the whole process group: the parent stops the runner, which must not
    # print a KeyboardInterrupt traceback of its own (children spawned from the main
    # thread ignore it from their start: _sigint_ignored)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)  # a pack cut short is re-queued: its job is missing to the next scheduler

    if nice and hasattr(os, "nice"):
        os.nice(nice)
    if names is not None:
        os.environ[WORKER_NAME_ENV] = names.get()
    if threads is not None:
        os.environ.setdefault(THREADS_ENV, str(threads))
    if "fork" in multiprocessing.get_all_start_methods() and sys.platform == "linux":
        # This child was spawned, so processes it starts would be spawned too: a workload's
        # DataLoader workers would then re-import torch every epoch (seconds each) and need a
        # picklable dataset. Fork them, as in any Linux process (and as RQ's work-horse does).
        multiprocessing.set_start_method("fork", force=True)
    threading.Thread(target=watch, name="packtune-parent-watch", daemon=True).start()
    if nudges is not None:
        from worker.jobs import listen_for_nudges

        listen_for_nudges(nudges)


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a runner may be spawned (from the main thread only, where Python
    lets signals be set): a spawned interpreter keeps an ignored SIGINT ignored, so a Ctrl-C
    during its start-up (its imports, before the initializer runs) prints no traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _warm_up(workload: str | None) -> str:
    """In the child, ahead of its first pack: import what packs need, start the device and
    load ``workload``'s in-memory data (with its defaults: the built-ins' data do not depend
    on the searched parameters). A failure is only logged: the pack that needs it will raise it."""
    started = time.perf_counter()
    try:
        import torch
        from sqlalchemy.orm import configure_mappers

        from packtune.workloads import get_workload
        from worker.jobs import pick_device

        configure_mappers()  # the models' (~0.1 s on a CPU): else at the first pack's claim
        device = pick_device()
        torch.zeros(1, device=device)  # on a GPU: the CUDA context, seconds
        chosen = get_workload(workload) if workload is not None else None
        if chosen is not None and not chosen.streams:  # a streaming one has no data() to load
            chosen.data({}, device)
        # What is alive now (torch's ~10^6 objects, the data) lives as long as the runner:
        # out of the collector's way, so that the first pack's memory probe collects in
        # milliseconds (a full collection with them in it took ~0.12 s on a CPU, on the
        # first pack's critical path). Frozen, not collected first: that collection would
        # cost the same 0.12 s here.
        gc.freeze()
    except DeviceUnavailable:
        raise  # nothing can train here: packtune run stops on it (worker.jobs.pick_device)
    except Exception as exc:
        log.warning("embedded runner: warm-up failed (%s: %s)", type(exc).__name__, exc)
        return f"failed: {exc}"
    return f"warm in {time.perf_counter() - started:.2f} s"


def _run_in_child(pack_id: int) -> str:
    from worker.jobs import run_pack  # imported in the child only

    return str(run_pack(pack_id))


def _check_in_child(check_id: int) -> str:
    from worker.jobs import run_check  # imported in the child only

    return str(run_check(check_id))


def runner_names(runners: int) -> list[str]:
    """The worker names of ``runners`` embedded runners: the first is ``embedded@host`` (the
    name a lone runner always had), then ``embedded-2@host``..."""
    host = socket.gethostname()
    return [f"embedded@{host}"] + [f"embedded-{i}@{host}" for i in range(2, runners + 1)]


def runner_threads(runners: int, settings: Settings) -> int | None:
    """Torch threads per runner when there are several and none are set: all cores but one
    (a lone runner's default), shared out."""
    if runners == 1 or settings.torch_threads is not None:
        return None
    return default_torch_threads(share=runners)


def checkpoint_folder_problem(folder: Path) -> str | None:
    """Why packs could not save checkpoints in ``folder`` (created if missing), on one line;
    None when they can. Every process that trains checks it before its first pack: a pack
    that cannot save fails only after its training, and is retried, a dozen times."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".packtune-write-check-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        return f"checkpoint folder {folder} is not writable: {exc.strerror or exc}"
    return None


class EmbeddedDispatcher:
    """Runs packs in spawned child processes, each one pack at a time, in order (FIFO)."""

    def __init__(self, settings: Settings) -> None:
        # on a GPU every runner would plan packs for the whole device: one
        on_cpu = settings.device == "cpu" or (settings.device == "auto" and not gpu_readings())
        self.runners = settings.embedded_runners if on_cpu else 1
        self._names = runner_names(self.runners)
        self.embedded_workers = frozenset(self._names)
        self._threads = runner_threads(self.runners, settings)
        self._nice = settings.runner_nice
        self._device, self._memory_budget = settings.device, settings.cpu_memory_budget
        self._ctx = multiprocessing.get_context("spawn")
        #: set to nudge the runner's pack watch; made with the runner, released at close (its
        #: five named semaphores would otherwise outlive a ``packtune run`` that ends with
        #: ``os._exit``, and multiprocessing's tracker would warn of them)
        self._nudges: Any = None
        self._names_queue: Any = None  # the runners' names, as long as their pool lives
        self._pool: ProcessPoolExecutor | None = None
        self._jobs: dict[str, Future[str]] = {}
        self._pools: dict[int, ProcessPoolExecutor] = {}  # id of a job's future: its pool
        self._dropped = False  # a broken pool was forgotten
        self.warm_ups: list[Future[str]] = []  # one a runner (a fast one may take two)
        self.notify: Callable[[], None] | None = None  # called when a job ends

    def start(self, workload: str | None = None) -> None:
        """Start the children now (spawn and imports take ~1.5 s on a CPU) and warm them up;
        packs enqueued meanwhile run after the warm-ups, in order."""
        if self._pool is None:
            pool = self._executor()
            with _sigint_ignored():  # the children spawned now start ignoring Ctrl-C
                self.warm_ups = [pool.submit(_warm_up, workload) for _ in range(self.runners)]

    def _submit(self, arg: int, job: Callable[[int], str]) -> Future[str]:
        pool = self._executor()
        with _sigint_ignored():  # the child it may spawn now starts ignoring Ctrl-C
            fut = pool.submit(job, arg)
        self._pools[id(fut)] = pool
        fut.add_done_callback(lambda _: self.notify() if self.notify else None)
        return fut

    def _drop(self, pool: ProcessPoolExecutor | None) -> None:
        """Forget ``pool``, broken (a runner died), if it is still the current one, with its
        nudge event: the dead runner may have been waiting on it, and setting an event a
        dead process waits on blocks for ever (the next runner's pack watch did, at its
        first pack's end, and every later pack waited behind it)."""
        if pool is None or pool is not self._pool:
            return
        self._pool = None
        self._nudges = None
        self._names_queue = None
        self._pools = {key: p for key, p in self._pools.items() if p is not pool}
        self._dropped = True
        pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            if self._nudges is None:
                self._nudges = self._ctx.Event()
            names = None
            if self.runners > 1:  # each child takes one at start (a replaced pool: anew)
                names = self._names_queue = self._ctx.SimpleQueue()
                for name in self._names:
                    names.put(name)
            self._pool = ProcessPoolExecutor(
                max_workers=self.runners,
                mp_context=self._ctx,
                initializer=_init_runner,
                initargs=(os.getpid(), self._nice, self._nudges, names, self._threads),
            )
        return self._pool

    def enqueue(self, pack_id: int, job_id: str) -> None:
        self._enqueue(job_id, pack_id, _run_in_child)

    def enqueue_check(self, check_id: int, job_id: str) -> None:
        """The check runs in the same child, after the packs enqueued before it."""
        self._enqueue(job_id, check_id, _check_in_child)

    def _enqueue(self, job_id: str, arg: int, job: Callable[[int], str]) -> None:
        try:
            self._jobs[job_id] = self._submit(arg, job)
        except BrokenProcessPool:
            log.warning("embedded runner died; starting a new one")
            self._drop(self._pool)
            self._jobs[job_id] = self._submit(arg, job)

    def state(self, job_id: str) -> tuple[JobState, str | None]:
        fut = self._jobs.get(job_id)
        if fut is None:
            return JobState.missing, None
        if not fut.done():
            return (JobState.running if fut.running() else JobState.queued), None
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, BrokenProcessPool):
                self._drop(self._pools.get(id(fut)))
            return JobState.failed, f"{type(exc).__name__}: {exc}"
        return JobState.finished, None

    def forget(self, job_id: str) -> None:
        fut = self._jobs.pop(job_id, None)
        if fut is not None:
            self._pools.pop(id(fut), None)

    def busy(self) -> int:
        """Jobs submitted and not yet done."""
        return sum(not f.done() for f in self._jobs.values())

    def runner_statuses(self) -> list[dict[str, Any]]:
        """The runners' heartbeats, written by the scheduler (a runner has no loop of its own
        to send one): the device as NVML sees it (no torch in this process), and whether
        each has a pack (as many as there are jobs out, first names first)."""
        # the GPU the runner trains on (torch's cuda:0, by its NVML index), not the host's first
        gpus = cuda_device_readings(0) if self._device != "cpu" else []
        busy = self.busy()
        return [
            {
                "name": name,
                "device_kind": gpus[0]["name"] if gpus else "cpu",
                "gpus": gpus[:1],
                "memory_budget": self._memory_budget,
                "busy": i < busy,
            }
            for i, name in enumerate(self._names)
        ]

    def nudge(self) -> None:
        """The running pack's watch reads its row at once (it looks every
        ``YIELD_CHECK_SECONDS`` otherwise)."""
        if self._nudges is not None:
            self._nudges.set()

    def close(self) -> None:
        """Stop the runner at once: closed during its start-up (e.g. the database could not be
        migrated) there is nothing to finish, so do not wait seconds for its imports; closed
        with a pack training (the scheduler stopped), the pack is cut short as if the runner
        had been killed, and the next scheduler finds its job missing and dispatches it again;
        closed idle, its jobs' writes are all committed, so do not wait for its interpreter's
        clean-up either (~0.1 s with torch loaded, at the end of every ``packtune run``)."""
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._nudges = None  # the last reference: its semaphores are unlinked now
        self._names_queue = None
        self._pools.clear()
        if self._dropped:  # a broken pool's event, held in reference cycles until collected
            gc.collect()
