"""GPU readings from NVML (``pynvml``, package nvidia-ml-py) for worker heartbeats.

Where NVML is missing (no driver, a CPU-only host) :func:`gpu_readings` logs
one warning, the first time, and returns ``[]``: it never raises, so a
heartbeat cannot die on it.

Indices here are NVML's, which count every GPU on the host. Torch's
``cuda:N`` counts only the GPUs in ``CUDA_VISIBLE_DEVICES``;
:func:`nvml_index` translates, and :func:`cuda_device_readings` reads the GPU
behind a torch device.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


@functools.cache
def _nvml() -> ModuleType | None:
    """pynvml, initialised once per process; ``None`` where there is none.

    No NVIDIA library at all is a machine without an NVIDIA GPU (a laptop running
    ``packtune run``): said once at INFO, since every run there would otherwise print a
    warning about nothing. A library that is there but fails (a driver not loaded, a
    mismatch) is a GPU box in trouble: a warning. A worker that trains on CUDA without
    NVML warns (:func:`warn_if_cuda_without_nvml`).
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - missing library, driver or device alike
        missing = type(exc).__name__ == "NVMLError_LibraryNotFound"
        log.log(logging.INFO if missing else logging.WARNING, "NVML not available: %s", exc)
        return None
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _reading(nvml: ModuleType, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except nvml.NVMLError:  # not supported, e.g. on MIG instances
        utilization = None
    return {
        "index": index,
        "name": _text(nvml.nvmlDeviceGetName(handle)),
        "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
        "memory_total": int(memory.total),
        "memory_used": int(memory.used),
        "memory_free": int(memory.free),
        "utilization": utilization,
    }


def gpu_readings(index: int | None = None) -> list[dict[str, Any]]:
    """One dict per GPU (only GPU ``index`` when given); ``[]`` without NVML.

    Keys: ``index``, ``name``, ``uuid``, ``memory_total``, ``memory_used``,
    ``memory_free`` (bytes) and ``utilization`` (percent; ``None`` where the
    device does not report it).
    """
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        count = int(nvml.nvmlDeviceGetCount())
        if index is not None and not 0 <= index < count:
            log.warning("no GPU with NVML index %d (there are %d)", index, count)
            return []
        indices = range(count) if index is None else [index]
        return [_reading(nvml, i) for i in indices]
    except nvml.NVMLError as exc:
        log.warning("NVML reading failed: %s", exc)
        return []


def nvml_index(
    cuda_index: int,
    visible: str | None = None,
    readings: Sequence[Mapping[str, Any]] = (),
) -> int | None:
    """The NVML index of torch's ``cuda:<cuda_index>``, or ``None`` if it cannot be told.

    ``visible`` is the ``CUDA_VISIBLE_DEVICES`` value (read from the
    environment when ``None``; unset means every GPU, in NVML order). Its
    entries are indices or UUID prefixes; the latter are looked up in
    ``readings``.
    """
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return cuda_index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= cuda_index < len(entries):
        return None
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry)
    matches = [int(r["index"]) for r in readings if str(r.get("uuid", "")).startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def device_label(worker: str, device: Any) -> str:
    """``worker``'s ``device`` as the planner names it from the heartbeats: a GPU by its NVML
    index (torch's ``cuda:0`` is GPU 3 under ``CUDA_VISIBLE_DEVICES=3``, and the heartbeat
    says 3), anything else by torch's name."""
    if getattr(device, "type", None) == "cuda":
        cuda_index = device.index or 0
        index = nvml_index(cuda_index)
        if index is None:  # UUIDs in CUDA_VISIBLE_DEVICES: NVML tells which GPU
            index = nvml_index(cuda_index, readings=gpu_readings())
        if index is not None:
            return f"{worker}/cuda:{index}"
    return f"{worker}/{device}"


def cuda_device_readings(cuda_index: int = 0) -> list[dict[str, Any]]:
    """Readings of the GPU torch calls ``cuda:<cuda_index>`` (``[]`` if unknown or no NVML)."""
    readings = gpu_readings()
    index = nvml_index(cuda_index, readings=readings)
    return [r for r in readings if r["index"] == index]


@functools.cache
def warn_if_cuda_without_nvml() -> None:
    """Once per process, where torch trains on CUDA: warn if NVML cannot see the GPU."""
    if _nvml() is None:
        log.warning(
            "training on CUDA without NVML (nvidia-ml-py and the driver's libnvidia-ml): the "
            "worker reports its device as a CPU's, so packs are planned for the wrong memory"
        )


def device_kind(readings: Sequence[Mapping[str, Any]], index: int | None = None) -> str:
    """The worker's device kind: the name of GPU ``index`` (or the first GPU), else ``"cpu"``."""
    for reading in readings:
        if index is None or reading["index"] == index:
            return str(reading["name"])
    return "cpu"
