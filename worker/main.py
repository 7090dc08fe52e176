"""``packtune worker``: an RQ worker that trains packs and sends NVML heartbeats.

It is a ``SimpleWorker`` (jobs run in the worker process, not a forked child):
the CUDA context, imported torch and loaded datasets survive from one pack to
the next. A crash kills the worker; its heartbeat stops and the scheduler
re-queues its pack. Each job's end is announced on a Redis channel
(``service.bus.announce``), so that the scheduler plans the next
packs at once instead of at its next tick.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from rq import SimpleWorker

from packtune.dispatcher import rq_worker_name
from packtune.errors import DeviceUnavailable
from packtune.settings import WORKER_NAME_ENV, get_settings
from service.bus import announce
from worker.embedded import checkpoint_folder_problem

log = logging.getLogger(__name__)


def preflight() -> str | None:
    """What stops this worker from doing its job, checked before it takes a pack: its
    checkpoint folder must be writable (created if missing), its database must answer, and
    when live workers run on other hosts the folder must be the one they share (each host
    leaves a ``.packtune-host-<name>`` marker in it; another host's marker must show here).
    None when all hold; else one line saying what is wrong."""
    from service import store
    from service.db import DATABASE_ERRORS, missing_file_problem, ping, retrying, schema_problem

    settings = get_settings()
    folder = settings.checkpoint_dir
    problem = checkpoint_folder_problem(folder) or missing_file_problem(settings.database_url)
    if problem is not None:  # the folder: what an embedded runner checks too
        return problem
    try:
        ping()
    except DATABASE_ERRORS as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"cannot reach the database (PACKTUNE_DATABASE_URL): {first}"
    schema = schema_problem(settings.database_url)
    if schema is not None:
        return schema
    host = socket.gethostname()
    (folder / f".packtune-host-{host}").write_text(host)
    live = retrying(lambda s: store.live_workers(s, settings.heartbeat_timeout))
    others = sorted({w.host for w in live if w.host and w.host != host})
    unseen = [h for h in others if not (folder / f".packtune-host-{h}").exists()]
    if unseen:
        return (
            f"checkpoint folder {folder} is not shared with the workers on "
            f"{', '.join(unseen)}: mount the same folder on every host (e.g. NFS)"
        )
    return None


def reclaim(name: str) -> list[int]:
    """Re-queue the packs a previous process of this worker name died training.

    A worker name outlives its process (``--gpu N`` fixes it, and a container restart
    policy starts the same name again at once): its heartbeats go on, so the scheduler
    would see the dead process's pack as running until the job's timeout. One process
    per name is the contract, so a pack running under this name when it starts is dead.
    """
    from service import store
    from service.db import retrying

    moved = retrying(
        lambda s: store.requeue_packs_of(s, name, f"worker {name} restarted while training it")
    )
    if moved:
        log.warning("worker %s restarted: packs %s it was training go back to the queue",
                    name, moved)  # fmt: skip
    return moved


def readings_with_headroom(index: int | None) -> list[dict[str, Any]]:
    """NVML readings of the GPU this worker trains on (``index``; without one, the GPU torch
    calls ``cuda:0``: a worker trains one pack at a time there, not on every GPU of the
    host); ``memory_available`` adds back what this process's torch holds (packs run one at
    a time, so the next pack may use it)."""
    from worker.gpu import cuda_device_readings, gpu_readings

    readings = gpu_readings(index=index) if index is not None else cuda_device_readings(0)
    torch = sys.modules.get("torch")
    reserved = 0
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        reserved = int(torch.cuda.memory_reserved())
    for r in readings:
        r["memory_available"] = int(r["memory_free"]) + reserved
    return readings


def send_heartbeat(name: str, index: int | None, busy: bool) -> None:
    from service import store
    from service.db import session_scope
    from service.models import WorkerStatus

    settings = get_settings()
    readings = readings_with_headroom(index) if settings.device != "cpu" else []
    with session_scope() as s:
        store.heartbeat(
            s,
            name=name,
            host=socket.gethostname(),
            device_kind=readings[0]["name"] if readings else "cpu",
            gpus=readings,
            memory_budget=None if readings else settings.cpu_memory_budget,
            status=WorkerStatus.busy if busy else WorkerStatus.idle,
        )


class Heartbeat(threading.Thread):
    def __init__(self, name: str, index: int | None, interval: float) -> None:
        super().__init__(name="packtune-heartbeat", daemon=True)
        self.worker_name, self.index, self.interval = name, index, interval
        self.busy = False
        self.stop = threading.Event()
        self.changed = threading.Event()

    def mark(self, busy: bool) -> None:
        """Training a job or not: sent at once (the API and dashboard show it)."""
        self.busy = busy
        self.changed.set()

    def run(self) -> None:
        while not self.stop.is_set():
            self.changed.clear()
            try:
                send_heartbeat(self.worker_name, self.index, self.busy)
            except Exception as exc:  # the database may be restarting; try again next beat
                log.warning("heartbeat failed: %s", exc)
            self.changed.wait(self.interval)


class PackWorker(SimpleWorker):
    """A ``SimpleWorker`` that announces each job's end once RQ has recorded it, and marks
    its worker busy in its heartbeat while a job runs."""

    #: packtune's heartbeat (not RQ's own ``heartbeat`` method)
    beat: Heartbeat | None = None

    def perform_job(self, job: Any, queue: Any, *args: Any, **kwargs: Any) -> bool:
        if self.beat is not None:
            self.beat.mark(True)
        try:
            return bool(super().perform_job(job, queue, *args, **kwargs))
        finally:
            if self.beat is not None:
                self.beat.mark(False)
            announce(self.connection, queue.name, job.id)


def run_worker(gpu: int | None = None, name: str | None = None, burst: bool = False) -> None:
    from redis import Redis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from rq import Queue

    settings = get_settings()
    if gpu is not None:
        # before torch is imported; GPU N as NVML (and the heartbeat, and nvidia-smi) number
        # it: CUDA's own default order puts the fastest first
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    # Import torch here, before the heartbeat thread starts: the thread reads torch.cuda, and
    # while the first job imports torch it would find the module half initialised and fail
    # for seconds (longer than a short heartbeat timeout).
    import torch  # noqa: F401

    from service.db import end_idle_transactions_after
    from worker.jobs import device_problem  # after CUDA_VISIBLE_DEVICES: it asks CUDA

    problem = device_problem(settings.device) or (None if gpu is None else gpu_problem(gpu))
    if problem is not None:
        raise DeviceUnavailable(problem)
    host = socket.gethostname()
    name = name or (f"{host}-gpu{gpu}" if gpu is not None else f"{host}-{os.getpid()}")
    os.environ[WORKER_NAME_ENV] = name
    assert settings.redis_url is not None
    redis = Redis.from_url(settings.redis_url)
    queue = Queue(settings.queue_name, connection=redis)
    # a transaction of this worker's left open by a partition ends with its locks
    end_idle_transactions_after(settings.heartbeat_timeout)
    reclaim(name)  # what a previous incarnation of this name died holding
    send_heartbeat(name, gpu, busy=False)  # fail fast on a bad database URL
    beat = Heartbeat(name, gpu, settings.heartbeat_interval)
    beat.start()
    log.info("worker %s listening on %s", name, settings.queue_name)
    delay, outage = 1.0, False
    rq_worker: PackWorker | None = None
    try:
        while True:
            try:
                # a new RQ name each time: Redis may still hold the last one's registration.
                # Made inside the try: RQ's constructor already talks to Redis, and a worker
                # re-made while Redis was still down used to exit
                rq_name = rq_worker_name(name, uuid.uuid4().hex[:8])
                rq_worker = PackWorker([queue], connection=redis, name=rq_name)
                rq_worker.beat = beat
                if outage:
                    log.warning("Redis is back; listening on %s", settings.queue_name)
                    outage, delay = False, 1.0
                rq_worker.work(burst=burst, with_scheduler=False)
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # RQ gives up on a Redis error outside its dequeue wait (e.g. in its own
                # heartbeat); a restarting Redis must not end the worker. One line per outage.
                stop_listening(rq_worker)
                if not outage:
                    log.warning("lost Redis (%s); trying again until it is back", exc)
                outage = True
                time.sleep(delay)
                delay = min(2 * delay, 10.0)
    finally:
        beat.stop.set()
        beat.changed.set()


def gpu_problem(gpu: int) -> str | None:
    """Why ``--gpu N`` cannot train on GPU ``gpu``; None where it can. Asked once
    ``CUDA_VISIBLE_DEVICES`` names it: CUDA then sees no GPU where there is no GPU N, and
    such a worker went on as ``host-gpuN``, training on the CPU. NVML counts the host's
    GPUs, in the numbering ``--gpu`` takes."""
    import torch

    from worker.gpu import gpu_readings

    if torch.cuda.is_available():
        return None
    count = len(gpu_readings())
    if gpu < count:  # NVML has it, CUDA cannot use it (a build without CUDA, a MIG GPU)
        return f"GPU {gpu} is there, but torch {torch.__version__} cannot train on it"
    there = "no GPU" if count == 0 else "GPU 0" if count == 1 else f"GPUs 0 to {count - 1}"
    return f"no GPU {gpu} here: NVML finds {there}"


def stop_listening(rq_worker: Any) -> None:
    """Stop the thread an RQ worker that gave up listens on its command channel with: it
    would retry for ever, an error line every 2 s while Redis is down, and then keep a
    connection subscribed to a channel nobody sends to (one more per outage)."""
    thread = getattr(rq_worker, "pubsub_thread", None)
    if thread is not None:
        thread.stop()  # its loop ends at its next turn and closes its connection
        rq_worker.pubsub_thread = None


def gpus_to_run(readings: list[dict[str, Any]], visible: str | None) -> list[int]:
    """The NVML indices of the GPUs ``--all-gpus`` starts a worker on: every one NVML reads,
    or where ``CUDA_VISIBLE_DEVICES`` (``visible``) is set, those it names (indices as
    nvidia-smi numbers them, or UUID prefixes), up to the first it cannot place, as CUDA
    reads it; a GPU named twice once."""
    indices = [int(r["index"]) for r in readings]
    if visible is None:
        return indices
    chosen: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            found = [int(entry)] if int(entry) in indices else []
        else:
            found = [
                int(r["index"]) for r in readings if entry and str(r["uuid"]).startswith(entry)
            ]
        if len(found) != 1:
            break
        if found[0] not in chosen:
            chosen.append(found[0])
    return chosen


#: seconds before a GPU's worker that exited is started again: doubled while it keeps
#: exiting within :data:`SETTLED_SECONDS`, up to the last
RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
SETTLED_SECONDS = 60.0


def run_all_gpus(burst: bool = False) -> int:
    """One ``packtune worker --gpu N`` process per visible GPU (one CPU worker if none).

    A worker that exits while this one runs (killed for memory, a CUDA fault) is started
    again under its name, which takes back what it held, after a delay that grows while
    it keeps exiting: its GPU would otherwise idle for as long as the container is up.
    With ``burst``, workers end when the queue is empty and are not started again.
    Returns the first non-zero exit code once every worker has ended."""
    from worker.gpu import gpu_readings

    readings, visible = gpu_readings(), os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpus_to_run(readings, visible)
    if readings and not gpus:
        log.warning("CUDA_VISIBLE_DEVICES=%r names no GPU NVML reads (MIG instances?): one "
                    "worker, on what it shows CUDA", visible)  # fmt: skip
    base = [sys.executable, "-m", "service", "worker"] + (["--burst"] if burst else [])
    commands: dict[int | None, list[str]] = (
        {gpu: base + ["--gpu", str(gpu)] for gpu in gpus}
        if gpus
        else {None: base + ["--name", f"{socket.gethostname()}-cpu"]}  # the same when restarted
    )
    procs = {slot: subprocess.Popen(cmd) for slot, cmd in commands.items()}
    started = {slot: time.monotonic() for slot in procs}
    failures = dict.fromkeys(procs, 0)
    stopping = threading.Event()
    asked: list[int] = []  # the signal forwarded: a worker it ended did as asked

    def forward(signum: int, _frame: object) -> None:
        asked.append(signum)
        stopping.set()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: list[int] = []
    pending: dict[int | None, float] = {}  # slot -> when to start it again
    while procs or pending:
        now = time.monotonic()
        for slot, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[slot]
            if stopping.is_set() or burst:
                codes.append(0 if -code in asked else code)  # its last exit: what this returns
                continue
            failures[slot] = 1 if now - started[slot] > SETTLED_SECONDS else failures[slot] + 1
            delay = RESTART_DELAYS[min(failures[slot], len(RESTART_DELAYS)) - 1]
            where = "the CPU" if slot is None else f"GPU {slot}"
            log.warning("the worker on %s exited (code %s); starting it again in %.0f s",
                        where, code, delay)  # fmt: skip
            pending[slot] = now + delay
        for slot, due in list(pending.items()):
            if stopping.is_set():
                del pending[slot]
            elif now >= due:
                del pending[slot]
                procs[slot] = subprocess.Popen(commands[slot])
                started[slot] = time.monotonic()
                if stopping.is_set():  # the signal came while it was being started
                    procs[slot].send_signal(asked[-1])
        stopping.wait(0.2)
    return next((c for c in codes if c), 0)
