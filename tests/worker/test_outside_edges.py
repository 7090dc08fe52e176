"""Values kept outside the model, in the forms a review of their handling found mishandled:
an array set anew per trial that the model shares, a submodule imported inside a forward,
tensors without a version counter, a cache filled on first use, a resumed array's own
module-global buffer, a slot whose name is mangled, a NumPy dtype torch lacks, a build's
``torch.set_default_device("cpu")``. Each test failed before its fix."""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn

import tests.support.lazy_pkg
from tests.support.tiny_workloads import TinyMLP
from tests.worker.test_outside_state import EPOCHS, assert_as_alone, members, results
from worker import outside_state as outside
from worker.fused import FusedArray, train
from worker.outside_state import resumed_value, saved_value
from worker.outside_values import Fields, hold, put

#: the default shift; ShiftAnew.build_model sets its trial's anew (its model shares it)
SHIFT = numpy.zeros(16)


class _Shifted(nn.Module):
    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) + self.shift)


class _Scaled(TinyMLP):
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})


class ShiftAnew(_Scaled):
    name = "shift-anew"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        global SHIFT
        SHIFT = numpy.full(16, float(self.resolve(config)["scale"]))  # set anew
        return _Shifted(torch.from_numpy(SHIFT)).double()  # the buffer shares its memory


def test_an_array_set_anew_per_trial_is_not_overwritten_by_the_next_build() -> None:
    """Before, the next member's build started by filling the start value into the array
    that was there: the earlier member's, whose model's buffer shares its memory."""
    global SHIFT
    w, group = ShiftAnew(), members([2.0, 3.0])
    want = {}
    for key, config in group:
        SHIFT = numpy.zeros(16)
        solo = FusedArray(copy.copy(w), [(key, config)])
        train(solo, EPOCHS * solo.steps_per_epoch)
        want[key] = results(solo)[key]
    SHIFT = numpy.zeros(16)
    array = FusedArray(copy.copy(w), group)
    assert (array.member_state("t0")["buffers"]["shift"] == 2.0).all()
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)


class _LazyImport(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import tests.support.lazy_pkg.extra  # first imported here

        return tests.support.lazy_pkg.extra.scale(self.fc2(torch.relu(self.fc1(x))))


class LazyImport(_Scaled):
    name = "lazy-import"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _LazyImport().double()


def test_a_submodule_imported_inside_a_forward_stays_imported() -> None:
    """Before, the probe took the package's new attribute for training state, and removed it
    before each step: AttributeError."""
    sys.modules.pop("tests.support.lazy_pkg.extra", None)
    vars(tests.support.lazy_pkg).pop("extra", None)
    array = FusedArray(LazyImport(), members([1.0, 1.0]))
    train(array, array.steps_per_epoch)
    assert "extra" in vars(tests.support.lazy_pkg)


with torch.inference_mode():
    #: a lookup table made in inference mode (no version counter), larger than held values
    TABLE = torch.randn(100, 100)
    #: an nn.Module made in inference mode
    ENCODER = nn.Linear(4, 4)


def test_tensors_without_a_version_counter_are_left_alone() -> None:
    """Before, every build raised reading their version counters."""
    array = FusedArray(_Scaled(), members([1.0, 1.0]))
    train(array, array.steps_per_epoch)
    assert not any("in place" in n for n in array.notes)


#: a helper loaded on first use (a perceptual loss's network, say)
_HELPER: nn.Module | None = None
#: a memo of masks per batch size, filled on first use
_MASKS: dict[int, torch.Tensor] = {}


def helper() -> nn.Module:
    global _HELPER
    if _HELPER is None:
        helper.loads += 1  # type: ignore[attr-defined]  # (a function's own: not read)
        _HELPER = nn.Identity()
    return _HELPER


helper.loads = 0  # type: ignore[attr-defined]


class _Memo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in _MASKS:
            _MASKS[n] = torch.ones(n, 1, dtype=x.dtype)
        return self.fc2(torch.relu(self.fc1(x))) * _MASKS[n]


class LazyHelper(_Scaled):
    name = "lazy-helper"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _Memo().double()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(helper()(outputs), targets)


def test_a_cache_filled_on_first_use_is_not_training_state() -> None:
    """Before, the probe took the helper (None, then loaded) and the memo's new entries for
    values training changes: each array and stack loaded its own, under the exclusive lock."""
    w = LazyHelper()
    for i in range(3):
        array = FusedArray(copy.copy(w), members([1.0, 1.0], first=2 * i))
        train(array, array.steps_per_epoch)
        kept = {n for names in outside.kept(array.outside_spaces).values() for n in names}
        assert not kept & {"_HELPER", "_MASKS"}, kept
        assert [len(keys) for keys, _ in array.stacks] == [2]
    assert helper.loads == 1  # type: ignore[attr-defined]


#: a constant table its model holds as a buffer (the same tensor in every model)
PE = torch.linspace(0, 1, 16 * 300, dtype=torch.float64).reshape(300, 16)


class _SharedTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.register_buffer("pe", PE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) + self.pe[0])


class SharedTable(_Scaled):
    name = "shared-table"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _SharedTable().double()


def test_a_resumed_state_loaded_into_a_shared_buffer_is_not_said_to_be_a_builds_change() -> None:
    """Before, loading a resumed member's state into its model (which holds the module's
    table) counted as its build changing the table in place: a false warning."""
    w = SharedTable()
    array = FusedArray(copy.copy(w), members([1.0, 1.0]))
    train(array, array.steps_per_epoch)
    states = [array.member_state(key) for key in array.keys]
    resumed = FusedArray(copy.copy(w), members([1.0, 1.0]), states=states)
    assert not any("in place" in n for n in array.notes + resumed.notes), resumed.notes


def test_a_resumed_numpy_array_in_a_dict_is_a_numpy_array_again(tmp_path: Path) -> None:
    config = {"norm": numpy.ones(3), "name": "x"}
    built = hold(config, lambda cls: False)
    config["norm"][:] = 2.0
    entry = saved_value(hold(config, lambda cls: False))
    assert entry is not None
    torch.save(entry, tmp_path / "c.pt")
    config["norm"][:] = 0.0
    put(config, resumed_value(built, torch.load(tmp_path / "c.pt", weights_only=True)))
    assert type(config["norm"]) is numpy.ndarray and (config["norm"] == 2.0).all()


class Secret:
    __slots__ = ("__secret",)

    def __init__(self) -> None:
        self.__secret = 1

    def set(self, value: int) -> None:
        self.__secret = value

    def get(self) -> int:
        return self.__secret


def test_a_slot_of_a_mangled_name_is_held() -> None:
    secret = Secret()
    held = hold(secret, lambda cls: cls is Secret)
    assert isinstance(held, Fields)
    secret.set(5)
    put(secret, held)
    assert secret.get() == 1


def test_an_array_of_a_dtype_torch_lacks_is_not_saved_rather_than_failing() -> None:
    for array in (numpy.ones(3, dtype=numpy.longdouble), numpy.ones(3, dtype=">f4")):
        assert saved_value(hold(array, lambda cls: False)) is None


class CpuDefault(_Scaled):
    name = "cpu-default"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        torch.set_default_device("cpu")  # as a fresh process has it
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def test_a_build_that_sets_the_cpu_as_the_default_device_changes_nothing() -> None:
    try:
        array = FusedArray(CpuDefault(), members([1.0, 1.0]))
        assert not array.torch_own and not array.notes
    finally:
        torch.set_default_device(None)
