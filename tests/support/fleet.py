"""A fleet in the database, as the scheduler finds it: workers and measured workloads."""

from __future__ import annotations

from sqlalchemy.orm import Session

from packtune.space import fusion_key
from packtune.workloads import get_workload
from service import store
from service.models import WorkerStatus


def idle_cpu_worker_for(s: Session, name: str, workload: str = "digits-mlp") -> None:
    """An idle CPU worker ``name`` (4 GiB), and ``workload``'s default fusion key measured on
    the CPU already: the scheduler dispatches its packs to it at once, with no probe pack."""
    store.heartbeat(
        s, name=name, host="test", device_kind="cpu", gpus=[],
        memory_budget=4 * 2**30, status=WorkerStatus.idle,
    )  # fmt: skip
    wl = get_workload(workload)
    key = fusion_key(wl.name, wl.resolve({}), wl.structural_params())
    store.record_throughput(s, wl.name, key, "cpu", 1, 100.0)
