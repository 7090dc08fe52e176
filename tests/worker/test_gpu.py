"""NVML readings: no NVML means [] and one line of log (INFO where there is no NVIDIA library
at all, a warning where it fails); real readings where there is a GPU."""

from __future__ import annotations

import logging

import pytest

from worker import gpu

READINGS = [
    {"index": 0, "name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-aaaa-1111"},
    {"index": 1, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-bbbb-2222"},
]


def test_without_nvml_readings_are_empty_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    gpu._nvml.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="worker.gpu"):
            first = gpu.gpu_readings()
            second = gpu.gpu_readings(index=0)
        if first:
            pytest.skip("NVML is available on this host")
        assert first == [] and second == []
        said = [r for r in caplog.records if "NVML not available" in r.getMessage()]
        assert len(said) == 1
        # no NVIDIA library: a CPU machine, not worth a warning on every `packtune run`
        library_missing = "Library Not Found" in said[0].getMessage()
        assert said[0].levelno == (logging.INFO if library_missing else logging.WARNING)
        assert gpu.device_kind(first) == "cpu"
        assert gpu.cuda_device_readings(0) == []
    finally:
        gpu._nvml.cache_clear()


def test_a_failing_nvml_library_is_a_warning_and_cuda_without_nvml_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pynvml = pytest.importorskip("pynvml")

    def broken() -> None:
        raise pynvml.NVMLError_DriverNotLoaded(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", broken)
    gpu._nvml.cache_clear()
    gpu.warn_if_cuda_without_nvml.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="worker.gpu"):
            assert gpu.gpu_readings() == []
            gpu.warn_if_cuda_without_nvml()
            gpu.warn_if_cuda_without_nvml()
        levels = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert levels[0][0] == logging.WARNING and "NVML not available" in levels[0][1]
        cuda = [m for level, m in levels if "training on CUDA without NVML" in m]
        assert len(cuda) == 1 and levels[-1][0] == logging.WARNING
    finally:
        gpu._nvml.cache_clear()
        gpu.warn_if_cuda_without_nvml.cache_clear()


def test_device_kind_names_the_chosen_gpu() -> None:
    assert gpu.device_kind(READINGS) == "NVIDIA A100-SXM4-40GB"
    assert gpu.device_kind(READINGS, index=1) == "NVIDIA H100 80GB HBM3"
    assert gpu.device_kind(READINGS, index=5) == "cpu"
    assert gpu.device_kind([]) == "cpu"


@pytest.mark.parametrize(
    ("cuda_index", "visible", "expected"),
    [
        (0, None, 0),  # (read from the environment below: unset)
        (0, "1", 1),
        (1, "3,2", 2),
        (2, "3,2", None),
        (0, "", None),
        (0, "GPU-bbbb", 1),
        (0, "GPU-", None),  # ambiguous prefix
        (0, "GPU-cccc", None),
    ],
)
def test_nvml_index_follows_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, cuda_index: int, visible: str | None, expected: int | None
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu.nvml_index(cuda_index, visible, READINGS) == expected


@pytest.mark.gpu
def test_real_readings_on_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpu._nvml.cache_clear()
    readings = gpu.gpu_readings()
    assert readings, "CUDA works, so NVML should too"
    for r in readings:
        assert set(r) == {
            "index",
            "name",
            "uuid",
            "memory_total",
            "memory_used",
            "memory_free",
            "utilization",
        }
        assert r["memory_total"] > 0
        assert 0 <= r["memory_free"] <= r["memory_total"]
        assert 0 <= r["memory_used"] <= r["memory_total"]
        assert r["utilization"] is None or 0 <= r["utilization"] <= 100
        assert r["name"] and r["uuid"].startswith(("GPU-", "MIG-"))
    assert [r["index"] for r in gpu.gpu_readings(index=0)] == [0]
    assert gpu.gpu_readings(index=len(readings)) == []
    mine = gpu.cuda_device_readings(0)
    assert len(mine) == 1
    assert gpu.device_kind(mine) == torch.cuda.get_device_name(0)
    _, cuda_total = torch.cuda.mem_get_info(0)  # CUDA leaves out the driver's reserve
    assert cuda_total <= mine[0]["memory_total"] <= 1.05 * cuda_total


def fake_nvml(monkeypatch: pytest.MonkeyPatch, visible: str | None) -> None:
    """Two GPUs as NVML sees them; ``CUDA_VISIBLE_DEVICES`` as given."""
    readings = [{**r, "memory_free": 8 * 2**30, "memory_total": 80 * 2**30} for r in READINGS]

    def fake(index: int | None = None) -> list[dict[str, object]]:
        return [dict(r) for r in readings if index is None or r["index"] == index]

    monkeypatch.setattr(gpu, "gpu_readings", fake)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


@pytest.mark.parametrize(
    "visible,label", [(None, "w/cuda:0"), ("1", "w/cuda:1"), ("GPU-bbbb", "w/cuda:1")]
)
def test_a_device_is_labelled_by_its_nvml_index(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, label: str
) -> None:
    """What a worker that trains on torch's cuda:0 calls its device when it claims a pack:
    the GPU its heartbeat reports (the planner's name), whatever torch calls it."""
    import torch

    fake_nvml(monkeypatch, visible)
    assert gpu.device_label("w", torch.device("cuda:0")) == label
    assert gpu.device_label("w", torch.device("cpu")) == "w/cpu"


@pytest.mark.parametrize("visible,index", [(None, 0), ("1", 1)])
def test_a_worker_and_a_runner_report_the_gpu_they_train_on(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, index: int
) -> None:
    """A ``packtune worker`` without ``--gpu`` trains on torch's cuda:0, one pack at a time:
    its heartbeat reports that GPU only. Before, it reported every GPU of the host (the
    planner saw two devices and planned packs for both). The embedded runner likewise
    reports the GPU it trains on, not the host's first."""
    from packtune.settings import get_settings
    from worker.embedded import EmbeddedDispatcher
    from worker.main import readings_with_headroom

    fake_nvml(monkeypatch, visible)
    assert [r["index"] for r in readings_with_headroom(None)] == [index]
    monkeypatch.setenv("PACKTUNE_DEVICE", "cuda")
    get_settings.cache_clear()
    runner = EmbeddedDispatcher(get_settings())
    try:
        statuses = runner.runner_statuses()
    finally:
        runner.close()
        get_settings.cache_clear()
    assert statuses and all([g["index"] for g in s["gpus"]] == [index] for s in statuses)
