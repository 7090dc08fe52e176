"""Data that is not a pair of tensors on the device, and steps of the workload's own.

Every fused array here is compared with its members trained alone (what an unpacked study
does), on real DataLoaders over image files written by the test, with a resume in the
middle of an epoch on the alone side: the streamed path must skip exactly the batches a
trial has trained on.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from packtune.workloads import get_workload
from packtune.workloads.base import Workload, epoch_generator
from tests.support.plugins import HERE
from worker.batches import epoch_batches, stack_batches, tree_map
from worker.fused import FusedArray, Report, train
from worker.memory import probe

sys.path.insert(0, str(HERE))
import stream_workloads as sw  # noqa: E402


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3,000 8x8 images, one .npy file each."""
    return sw.write_image_folder(tmp_path_factory.mktemp("images"))


def members(workload: Workload, extra: Mapping[str, Any], lrs: list[float]) -> list[Any]:
    return [
        (i, {**extra, "lr": lr, "seed": 100 + i, "data_seed": 7, "max_epochs": 3})
        for i, lr in enumerate(lrs)
    ]


def alone(workload: Workload, key: int, config: dict[str, Any], to_step: int) -> list[Report]:
    """``key`` trained by itself, stopped and resumed (a new array from its state) mid-epoch."""
    first = FusedArray(workload, [(key, config)])
    spe = first.steps_per_epoch
    reports = train(first, spe + 3)
    resumed = FusedArray(workload, [(key, config)], states=[first.member_state(key)])
    return reports + train(resumed, to_step)


def assert_same(fused: list[Report], key: int, solo: list[Report], rel: float) -> None:
    last, mine = fused[-1].metrics[key], solo[-1].metrics[key]
    for name, value in last.items():
        if name == "train_loss":  # the resumed run's last epoch counts fewer steps
            continue
        assert value == pytest.approx(mine[name], rel=rel, abs=1e-7), (key, name)
    for a, b in zip(fused[0].metrics[key].items(), solo[0].metrics[key].items(), strict=True):
        assert a[1] == pytest.approx(b[1], rel=rel, abs=1e-7), (key, a, b)


def test_a_dataloader_over_files_trains_fused_as_alone(root: Path) -> None:
    workload = sw.FolderImages()
    assert workload.streams and workload.interface_problem() is None
    array_members = members(workload, {"root": str(root)}, [0.01, 0.05, 0.2])
    array = FusedArray(workload, array_members)
    assert array.mode == "bmm" and array.train_split is None
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    assert len(reports) == 2
    for key, config in array_members:
        assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-6)
    # the members trained on something: different rates end in different places
    losses = {round(reports[-1].metrics[k]["val_loss"], 4) for k, _ in array_members}
    assert len(losses) == 3


def test_streamed_data_is_probed_on_its_first_validation_batch(root: Path) -> None:
    """A model of streamed data is probed before it trains, on the first validation batch:
    gradients of float rounding (a bias a BatchNorm cancels) under Adam train one member at a
    time from the start, as alone (before, no probe ran on streamed data, and fused members
    ended apart from their runs alone)."""
    workload = sw.BatchNormImages()
    workload.name = "batch-norm-images-probed"  # this process has not probed it yet
    extra = {"root": str(root), "optimizer": "adam"}
    array_members = members(workload, extra, [0.001, 0.003, 0.01])
    array = FusedArray(workload, array_members)
    assert [g.mode for g in array.groups] == ["serial"] * 3
    assert any("are float rounding ('net.1.bias'" in note for note in array.notes), array.notes
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    for key, config in array_members:
        assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-6)


def test_streamed_gradients_of_float_rounding_no_probe_saw_are_caught_at_the_first_step(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the loader gives no batch to probe with, the first step looks, before it steps:
    the members go on one at a time; later arrays of the model, in this process, train apart
    from the start."""
    from worker.probe import _LEARNED

    monkeypatch.setattr(FusedArray, "_probe_batches", lambda self: [])
    workload = sw.BatchNormImages()
    workload.name = "batch-norm-images-first"  # this process has not learned it yet
    extra = {"root": str(root), "optimizer": "adam"}
    array_members = members(workload, extra, [0.001, 0.003, 0.01])
    array = FusedArray(workload, array_members)
    assert array.mode == "vmap" and len(array.groups) == 1
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    assert [g.mode for g in array.groups] == ["serial"] * 3
    assert any("are float rounding ('net.1.bias':" in note for note in array.notes), array.notes
    for key, config in array_members:
        assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-6)
    later = FusedArray(workload, members(workload, extra, [0.002, 0.004]))
    assert [g.mode for g in later.groups] == ["serial"] * 2
    assert any("are float rounding" in note for note in later.notes)
    _LEARNED.clear()


@pytest.mark.parametrize("probed", [True, False])
def test_a_streamed_step_counter_is_not_taken_for_gradients_of_float_rounding(
    root: Path, monkeypatch: pytest.MonkeyPatch, probed: bool
) -> None:
    """A model keeping a Python step counter, under Adam: its probe (the first validation
    batch) sees the counter, which its checkpoints then carry, and no gradient of rounding.
    Without a batch to probe with, the first step's look runs the loss twice from the same
    state: before, the counter the first run moved made the second's gradient another one,
    and the members trained one at a time, with a note saying what was not so."""
    workload = sw.CountingImages()
    workload.name = f"counting-images-{probed}"  # this process has not probed it yet
    if not probed:
        monkeypatch.setattr(FusedArray, "_probe_batches", lambda self: [])
    extra = {"root": str(root), "optimizer": "adam"}
    array_members = members(workload, extra, [0.001, 0.003, 0.01])
    array = FusedArray(workload, array_members)
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    assert [g.mode for g in array.groups] == ["vmap"], array.notes
    for key, config in array_members:
        if probed:  # resumed mid-epoch: its checkpoint carries the counter
            assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-5)
        else:  # unbroken: no probe saw the counter for a checkpoint to carry
            solo = FusedArray(workload, [(key, config)])
            assert_same(reports, key, train(solo, 2 * spe), rel=1e-5)


def test_batches_per_member_follow_each_trial_not_its_pack(root: Path) -> None:
    workload = sw.AugmentedImages()
    array_members = members(workload, {"root": str(root)}, [0.02, 0.02, 0.1])
    array = FusedArray(workload, array_members)
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    for key, config in array_members:
        assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-6)
    # members 0 and 1 differ only in their seeds, so in their batches (and their init)
    a, b = (reports[-1].metrics[k]["train_loss"] for k in (0, 1))
    assert a != b
    one = next(iter(workload.train_batches(array_members[0][1], 0)))[0]
    two = next(iter(workload.train_batches(array_members[1][1], 0)))[0]
    assert not torch.equal(one, two)


def test_a_custom_step_with_dict_batches_and_two_outputs_runs_under_vmap(root: Path) -> None:
    workload = sw.MultiTask()
    array_members = members(workload, {"root": str(root)}, [0.01, 0.03, 0.05])
    array_members = [
        (key, {**config, "aux_weight": w})
        for (key, config), w in zip(array_members, [0.1, 1.0, 3.0], strict=True)
    ]
    array = FusedArray(workload, array_members)
    assert array.stacks == [([0, 1, 2], "vmap")] and not array.notes
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    assert set(reports[-1].metrics[0]) == {
        "train_loss", "val_loss", "val_accuracy", "val_brightness_mse",
    }  # fmt: skip
    for key, config in array_members:
        assert_same(reports, key, alone(workload, key, config, 2 * spe), rel=1e-5)
    # the fusible loss weight is each member's own: the brightness error falls with it
    mse = [reports[-1].metrics[k]["val_brightness_mse"] for k in (0, 1)]
    assert mse[1] < mse[0]


def test_a_custom_step_compiled_trains_as_the_eager_one(root: Path) -> None:
    """A workload's own step (dict batches, two outputs) under PACKTUNE_COMPILE_STEP: the
    compiled vmap of its training_loss, streamed batches, trains as the eager step does."""
    from worker import compiled

    workload = sw.MultiTask()
    array_members = members(workload, {"root": str(root)}, [0.01, 0.03])
    compiled.reset()
    try:
        eager = FusedArray(workload, array_members)
        got = FusedArray(workload, array_members, compile_step=True)
        spe = eager.steps_per_epoch
        want_reports, got_reports = train(eager, 2 * spe), train(got, 2 * spe)
        assert got.groups[0].compiled is not None and not got.notes
    finally:
        compiled.reset()
    for a, b in zip(want_reports, got_reports, strict=True):
        for key, metrics in a.metrics.items():
            assert b.metrics[key] == pytest.approx(metrics, rel=1e-5)


def test_a_step_vmap_cannot_batch_trains_members_one_at_a_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from worker import fused

    fused._LOGGED.discard(("split", "unbatchable"))  # logged once per process: this test's turn
    workload = sw.Unbatchable()
    array_members = members(workload, {}, [0.01, 0.03, 0.05])
    array = FusedArray(workload, array_members)
    assert array.stacks == [([0, 1, 2], "vmap")]
    with caplog.at_level("WARNING"):
        reports = train(array, 25)
    assert array.stacks == [([0], "serial"), ([1], "serial"), ([2], "serial")]
    assert "vmap could not run the fused step" in " ".join(array.notes)
    assert "train one at a time instead" in caplog.text
    for key, config in array_members:
        solo = FusedArray(workload, [(key, config)])
        assert solo.mode == "serial"
        mine = train(solo, 25)
        assert reports[-1].metrics[key] == mine[-1].metrics[key]


def test_a_loader_shorter_than_its_epoch_is_named() -> None:
    class Short(sw.Unbatchable):
        name = "short"

        def train_batches(self, config: Mapping[str, Any], epoch: int) -> Iterable[Any]:
            x, y = self.data(config)[0].x, self.data(config)[0].y
            return [(x[i : i + 50], y[i : i + 50]) for i in range(0, 200, 50)]  # 4 of 10

        def val_batches(self, config: Mapping[str, Any]) -> Iterable[Any]:
            split = self.data(config)[1]
            return [(split.x, split.y)]

    workload = Short()
    array = FusedArray(workload, members(workload, {}, [0.01]))
    with pytest.raises(ValueError, match=r"short.train_batches\(epoch=0\) yielded 4 batches"):
        train(array, 10)


def test_epoch_batches_skip_and_move_nested_batches() -> None:
    source = [{"a": torch.full((2,), i), "b": (torch.ones(2) * i,)} for i in range(6)]
    got = list(epoch_batches(source, 2, 3, torch.device("cpu"), "src"))
    assert [int(b["a"][0]) for b in got] == [2, 3, 4]
    stacked = stack_batches(got)
    assert stacked["a"].shape == (3, 2) and stacked["b"][0].shape == (3, 2)
    assert tree_map(lambda t: t.sum(), got[0])["b"][0] == 4.0


def test_the_memory_probe_counts_batches_not_a_streamed_data_set(root: Path) -> None:
    """A streamed data set stays on the host: the probe's base is the model and a batch or
    two, far below the in-memory twin's, which holds the whole data set on the device."""
    streamed = probe(sw.FolderImages(), {"root": str(root), "seed": 0}, ks=(1, 2), steps=1)
    data_bytes = (sw.N_TRAIN + sw.N_VAL) * 64 * 4
    assert 0 < streamed.bytes_for(1) < data_bytes / 4
    files = get_workload("digits-files")
    in_memory = probe(get_workload("digits-mlp"), {"seed": 0}, ks=(1, 2), steps=1)
    from_files = probe(files, {"seed": 0}, ks=(1, 2), steps=1)
    assert from_files.bytes_for(1) < in_memory.bytes_for(1) - 300_000  # 1797 x 64 floats


def test_the_built_in_streaming_workload_reads_its_files_through_a_dataloader() -> None:
    workload = get_workload("digits-files")
    config = {"seed": 5, "data_seed": 0, "augment": True}
    loader = workload.train_batches(config, 0)
    assert isinstance(loader, torch.utils.data.DataLoader)
    x, y = next(iter(loader))
    assert x.shape == (64, 64) and y.dtype == torch.int64
    again, _ = next(iter(workload.train_batches(config, 0)))
    other, _ = next(iter(workload.train_batches(config, 1)))
    assert torch.equal(x, again) and not torch.equal(x, other)
    two_workers, _ = next(iter(workload.train_batches({**config, "loader_workers": 2}, 0)))
    assert torch.equal(x, two_workers)  # augmentation drawn per example, not per process
    assert (
        epoch_generator(config, 0).initial_seed()
        != epoch_generator(config, 0, per_trial=True).initial_seed()
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_streamed_batches_are_prefetched_and_training_matches_alone(root: Path) -> None:
    """The prefetcher copies each batch on a side stream (pinned, non-blocking) and the
    fused array on the GPU still equals its members trained alone there."""
    from worker.batches import Prefetcher, on_device

    device = torch.device("cuda")
    source = [(torch.full((4, 3), float(i)), torch.arange(4)) for i in range(5)]
    moved = on_device(source, device)
    assert isinstance(moved, Prefetcher)
    got = list(moved)
    assert [float(x[0, 0]) for x, _ in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(x.device.type == "cuda" and y.device.type == "cuda" for x, y in got)
    workload = sw.FolderImages()
    array_members = members(workload, {"root": str(root)}, [0.01, 0.05])
    array = FusedArray(workload, array_members, device=device)
    spe = array.steps_per_epoch
    reports = train(array, 2 * spe)
    for key, config in array_members:
        solo = FusedArray(workload, [(key, config)], device=device)
        mine = train(solo, 2 * spe)
        assert reports[-1].metrics[key]["val_loss"] == pytest.approx(
            mine[-1].metrics[key]["val_loss"], rel=1e-5
        )


def test_a_loader_forks_its_workers_only_when_no_thread_is_inside_manual_seed() -> None:
    """Arrays train in threads; a loader forked while another thread is inside
    ``torch.manual_seed`` (holding torch's lazy-CUDA lock) gets a worker whose own
    ``manual_seed`` waits for ever. The other thread holds the RNG lock there (as array
    building does), so ``epoch_batches`` forks only once it is released. Before the fork
    waited for that lock, this loader's worker hung and the batch timed out."""
    import threading
    import time

    from worker.rng import GLOBAL_RNG

    inside = threading.Event()

    def seeding() -> None:  # what another array's member building does
        with GLOBAL_RNG, torch.cuda._initialization_lock:
            inside.set()
            time.sleep(1.5)

    data = torch.utils.data.TensorDataset(torch.arange(40.0).view(20, 2), torch.arange(20))
    loader = torch.utils.data.DataLoader(
        data, batch_size=5, num_workers=1, multiprocessing_context="fork", timeout=10
    )
    other = threading.Thread(target=seeding)
    other.start()
    inside.wait()
    try:
        got = list(epoch_batches(loader, 0, 4, torch.device("cpu"), "forked loader"))
    finally:
        other.join()
    assert [int(y[0]) for _, y in got] == [0, 5, 10, 15]


def test_the_digits_files_go_to_the_users_cache_where_the_data_folder_is_read_only(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compose mounts the data folder read-only at /data and sets PACKTUNE_DATA_DIR=/data:
    writing the files there failed every digits-files trial (found by an audit). A data
    folder that cannot be written to (here: a file in its place) now falls back to
    ``~/.cache/packtune``, with a warning."""
    from packtune.settings import get_settings
    from worker.workloads.digits_files import FOLDER, files_root

    blocked = tmp_path / "data"
    blocked.write_text("a file where the folder would be: nothing can be written under it")
    clean_env.setenv("PACKTUNE_DATA_DIR", str(blocked))
    clean_env.setenv("HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    with caplog.at_level("WARNING"):
        root = files_root()
    assert root == tmp_path / "home" / ".cache" / "packtune" / FOLDER
    assert len(list((root / "train").glob("*.npy"))) > 1000
    assert "cannot write the digits files under" in caplog.text
    assert files_root() == root  # found there from now on
