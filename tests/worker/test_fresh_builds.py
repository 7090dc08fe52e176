"""Values ``build_model`` sets for some trials only (``if cfg["scale"] != 1: SCALE = ...``),
keeping the value it found for the others: a module global, a class attribute, a settings
object changed in place, an attribute of the workload object (set anew or changed in place).

A trial run alone in a fresh process builds from the values its modules start with. Before,
a member built after another (in the same array, or in an array built after another in the
same process) found the other's value still there, and trained with it. Each member's build
now starts where a fresh process's would, and each member ends exactly as it ends trained
alone from the values its modules start with."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import pytest
import torch
from torch import nn

from tests.support.factory_workload import DeepFactoryGlobal, FactoryGlobal
from tests.support.tiny_workloads import TinyMLP
from tests.worker.test_outside_state import (
    EPOCHS,
    assert_as_alone,
    members,
    results,
    trained_as_alone_from,
)
from worker.fused import FusedArray, train
from worker.outside_state import MAX_HELD_LARGE

#: set by ConditionalGlobal.build_model for trials whose scale is not 1
SCALE = 1.0


@dataclass
class Settings:
    scale: float = 1.0


#: changed in place by ConditionalSettings.build_model for trials whose scale is not 1
SETTINGS = Settings()


@dataclass(slots=True)
class SlotSettings:
    scale: float = 1.0


#: a settings object with no ``__dict__``, changed in place by ConditionalSlots.build_model
SLOT_SETTINGS = SlotSettings()
#: a NumPy array filled in place by ConditionalArray.build_model (a normalisation constant)
FACTORS = numpy.ones(3)


class _Net(nn.Module):
    def __init__(self, read: Callable[[], Any]) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.read())


class _ClassNet(_Net):
    factor = 1.0  # set on the class by ConditionalClass.build_model for some trials


class _Conditional(TinyMLP):
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        scale = float(self.resolve(config)["scale"])
        if scale != 1.0:  # the default: nothing to set
            self.set(scale)
        return self.net().double()

    def set(self, scale: float) -> None:
        raise NotImplementedError

    def net(self) -> nn.Module:
        raise NotImplementedError

    def fresh(self) -> None:
        """Put the value where a fresh process has it."""
        raise NotImplementedError


class ConditionalGlobal(_Conditional):
    name = "conditional-global"

    def set(self, scale: float) -> None:
        global SCALE
        SCALE = scale

    def net(self) -> nn.Module:
        return _Net(lambda: SCALE)

    def fresh(self) -> None:
        global SCALE
        SCALE = 1.0


class ConditionalClass(_Conditional):
    name = "conditional-class"

    def set(self, scale: float) -> None:
        _ClassNet.factor = scale

    def net(self) -> nn.Module:
        return _ClassNet(lambda: _ClassNet.factor)

    def fresh(self) -> None:
        _ClassNet.factor = 1.0


class ConditionalSettings(_Conditional):
    name = "conditional-settings"

    def set(self, scale: float) -> None:
        SETTINGS.scale = scale

    def net(self) -> nn.Module:
        return _Net(lambda: SETTINGS.scale)

    def fresh(self) -> None:
        SETTINGS.scale = 1.0


class ConditionalSlots(_Conditional):
    name = "conditional-slots"

    def set(self, scale: float) -> None:
        SLOT_SETTINGS.scale = scale

    def net(self) -> nn.Module:
        return _Net(lambda: SLOT_SETTINGS.scale)

    def fresh(self) -> None:
        SLOT_SETTINGS.scale = 1.0


class ConditionalArray(_Conditional):
    name = "conditional-array"

    def set(self, scale: float) -> None:
        FACTORS[:] = scale

    def net(self) -> nn.Module:
        return _Net(lambda: float(FACTORS.mean()))

    def fresh(self) -> None:
        FACTORS[:] = 1.0


class _LossScaled(_Conditional):
    """Scales its loss by a value kept on its own object (its model is a plain MLP, which
    fuses)."""

    def net(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss(outputs, targets) * self.read()

    def read(self) -> Any:
        raise NotImplementedError


class ConditionalAttribute(_LossScaled):
    """Sets an attribute of its own object (the class gives the default)."""

    name = "conditional-attribute"
    scale = 1.0

    def set(self, scale: float) -> None:
        self.scale = scale

    def read(self) -> Any:
        return self.scale

    def fresh(self) -> None:
        vars(self).pop("scale", None)


class ConditionalHeld(_LossScaled):
    """Changes a settings object it made once in place."""

    name = "conditional-held"

    def __init__(self) -> None:
        super().__init__()
        self.settings = Settings()

    def set(self, scale: float) -> None:
        self.settings.scale = scale

    def read(self) -> Any:
        return self.settings.scale

    def fresh(self) -> None:
        self.settings.scale = 1.0


WORKLOADS = [
    ConditionalGlobal,
    ConditionalClass,
    ConditionalSettings,
    ConditionalSlots,
    ConditionalArray,
    ConditionalAttribute,
    ConditionalHeld,
]
#: built first in a test (the other tests build it after): nothing of it read yet
FIRST_BUILT: list[Any] = [FactoryGlobal, DeepFactoryGlobal]


#: their members with different values fuse (each stack's loss reads its member's)
LOSS_SCALED = (ConditionalAttribute, ConditionalHeld)


def fresh_alone(w: Any, member: tuple[Hashable, dict[str, Any]]) -> Any:
    """``member`` trained alone from the values a fresh process starts with."""
    w.fresh()
    solo = FusedArray(copy.copy(w), [member])
    train(solo, EPOCHS * solo.steps_per_epoch)
    return results(solo)[member[0]]


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_a_member_that_sets_nothing_trains_with_the_starting_value(
    workload: type[_Conditional],
) -> None:
    w = workload()
    group = members([2.0, 1.0, 3.0])
    want = {key: fresh_alone(w, (key, config)) for key, config in group}
    w.fresh()
    array = FusedArray(copy.copy(w), group)
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)
    assert len(array.stacks) == 3 or workload in LOSS_SCALED


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_an_array_built_after_another_starts_from_the_starting_value(
    workload: type[_Conditional],
) -> None:
    """The first array's build left its value behind in the process; the second array's
    member sets nothing."""
    w = workload()
    want = fresh_alone(w, members([1.0], first=5)[0])
    w.fresh()
    FusedArray(copy.copy(w), members([3.0]))
    array = FusedArray(copy.copy(w), members([1.0], first=5))
    train(array, EPOCHS * array.steps_per_epoch)
    assert_as_alone(results(array)["t5"], want, "t5")


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_members_that_set_nothing_still_fuse(workload: type[_Conditional]) -> None:
    """Starting each build from the starting value keeps equal members equal."""
    w = workload()
    w.fresh()
    FusedArray(copy.copy(w), members([3.0]))
    array = FusedArray(copy.copy(w), members([1.0, 1.0, 1.0], first=3))
    assert [len(keys) for keys, _ in array.stacks] == [3]


@pytest.mark.parametrize("workload", FIRST_BUILT, ids=lambda w: w.name)
def test_the_first_build_in_the_process_starts_from_the_starting_value(workload: Any) -> None:
    """The module the value is kept in (its model's, whose factory the workload's module
    imports; or one the factory's module imports) is read before the process's first build
    of the workload: its value then is known, and put back before each later build."""
    w = workload()
    group = members([2.0, 1.0])
    w.fresh()
    array = FusedArray(copy.copy(w), group)  # the first build in the process
    train(array, EPOCHS * array.steps_per_epoch)
    got = results(array)
    for key, config in group:
        assert_as_alone(got[key], fresh_alone(w, (key, config)), key)


#: a counter CountingGlobal's training forward keeps (a warm-up schedule, say)
COUNT = 0


class _CountingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global COUNT
        if self.training:
            COUNT += 1
        return self.fc2(torch.relu(self.fc1(x)) * (1.0 + 0.05 * COUNT))


class CountingGlobal(TinyMLP):
    name = "counting-global"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        return _CountingNet().double()


def test_a_counter_a_forward_keeps_in_a_module_global_starts_from_the_modules_value() -> None:
    """Alone in a fresh process, each trial's training counts from the module's 0. Before,
    the memory probe's forwards counted too, and so did every member and array trained
    earlier in the process: each trial read another count, packed or not."""
    global COUNT
    w = CountingGlobal()
    group = members([1.0, 1.0, 1.0])
    want = {}
    for key, config in group:
        COUNT = 0  # a fresh process's
        solo = FusedArray(copy.copy(w), [(key, config)])
        assert COUNT == 0  # its probe left no trace
        train(solo, EPOCHS * solo.steps_per_epoch)
        assert COUNT == EPOCHS * solo.steps_per_epoch
        want[key] = results(solo)[key]
    array = FusedArray(copy.copy(w), group)  # built after the others, the count left as is
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)
    # a number (not a tensor): each stack's forward counts once a step, as one member's does
    assert [len(keys) for keys, _ in array.stacks] == [3]


SCRIPT = """
import copy

from tests.support.tiny_workloads import TinyMLP
from tests.worker.test_outside_state import members
from worker.fused import FusedArray, train


class Plain(TinyMLP):
    name = "plain-in-a-script"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})


w = Plain()
built = []
for i in range(3):
    array = FusedArray(copy.copy(w), members([1.0], first=i))
    train(array, 2 * array.steps_per_epoch)
    built.append(array)
    assert array is built[-1], i
print("ok")
"""


def test_a_scripts_own_variables_are_left_alone(tmp_path: Any) -> None:
    """A workload defined in a script (``__main__``): the script's variables change between
    builds (``array = FusedArray(...)``), which is not the workload's state. Before, they
    were taken for values kept outside the model and put back around each step: ``array``
    named an array built earlier (or none) while the next one trained."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "study.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


#: set by DataScaled.build_model for trials whose scale is not 1, read by its data()
DATA_SCALE = 1.0


class DataScaled(_Conditional):
    """Its data() scales the inputs by a module global that its build sets for some
    trials: in a fresh process the data are read before any build, at the module's 1.0."""

    name = "data-scaled-global"

    def set(self, scale: float) -> None:
        global DATA_SCALE
        DATA_SCALE = scale

    def net(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def data(self, config: Mapping[str, Any], device: Any = "cpu") -> Any:
        from packtune.workloads.base import Split

        train, val = super().data(config, device)
        return Split(train.x * DATA_SCALE, train.y), Split(val.x * DATA_SCALE, val.y)

    def fresh(self) -> None:
        global DATA_SCALE
        DATA_SCALE = 1.0


def test_data_are_read_as_before_any_build() -> None:
    """An array built and trained before (its member's value put back around its steps)
    left the global set; the next array's data, read as a worker reads them (before its
    builds) or by the array itself (after them), were scaled by it."""
    from worker.execute import _read_data

    w = DataScaled()
    w.fresh()
    config = members([1.0], first=7)[0][1]
    want = w.data(w.resolve(config))[0].x
    array = FusedArray(copy.copy(w), members([3.0]))
    train(array, EPOCHS * array.steps_per_epoch)
    data, _ = _read_data(w, w.resolve(config), torch.device("cpu"))
    torch.testing.assert_close(data[0].x, want, rtol=0, atol=0)
    # the array's own read, after its members' builds (a 3.0 built last)
    array = FusedArray(copy.copy(w), members([1.0, 3.0], first=8))
    assert array.train_split is not None
    torch.testing.assert_close(array.train_split.x, want, rtol=0, atol=0)


def test_data_are_read_while_no_other_array_steps() -> None:
    """data() may draw from torch's generator (``torch.manual_seed(data_seed)``, then
    ``torch.randn``), or read a value another array's step has put back: it is read with the
    process's lock held alone, never while another array's step holds it (each of a pack's
    arrays reads its data in its own thread)."""
    import threading

    from tests.support.tiny_workloads import TinyMLP as Plain
    from worker.execute import _read_data
    from worker.rng import GLOBAL_RNG

    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def step() -> None:  # another array's step, holding the lock
        with GLOBAL_RNG:
            held.set()
            release.wait(30)

    def read() -> None:
        w = Plain()
        _read_data(w, w.resolve({"seed": 1, "data_seed": 1}), torch.device("cpu"))
        done.set()

    stepping = threading.Thread(target=step)
    stepping.start()
    assert held.wait(30)
    reading = threading.Thread(target=read)
    reading.start()
    try:
        assert not done.wait(0.5), "data were read while another array's step held the lock"
    finally:
        release.set()
        stepping.join()
        reading.join()
    assert done.is_set()


#: set by CheckedGlobal.build_model for trials whose scale is not 1 (no other test builds it)
CHECKED_SCALE = 1.0


class CheckedGlobal(_Conditional):
    name = "checked-global"

    def set(self, scale: float) -> None:
        global CHECKED_SCALE
        CHECKED_SCALE = scale

    def net(self) -> nn.Module:
        return _Net(lambda: CHECKED_SCALE)

    def fresh(self) -> None:
        global CHECKED_SCALE
        CHECKED_SCALE = 1.0


def test_packtune_checks_own_build_leaves_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """``packtune check`` (run in a worker process too) builds a model of its first member
    for itself: before, what that build set stayed, unlearned, as the process's value, and
    a later array's member that sets nothing trained with it, fused with one that set it."""
    from packtune.workloads import registry
    from worker.check import check

    w = CheckedGlobal()
    monkeypatch.setitem(registry(), w.name, w)
    w.fresh()
    space = {"scale": {"type": "choice", "values": [2.0]}}  # every member of the check: 2.0
    check(w.name, space, members=2, steps=2, ks=(1,))
    group = members([2.0, 1.0], first=20)
    array = FusedArray(copy.copy(w), group)
    train(array, EPOCHS * array.steps_per_epoch)
    got = results(array)
    for key, config in group:
        assert_as_alone(got[key], fresh_alone(w, (key, config)), key)


#: a projection larger than a small tensor, redrawn in place by LargeInPlace.build_model
PROJECTION = torch.zeros(80, 80, dtype=torch.float64)
#: the same, advanced in place by LargeInPlace's training forward (a running mean, say)
RUNNING = torch.zeros(80, 80, dtype=torch.float64)
#: the same as a NumPy array
RUNNING_ARRAY = numpy.zeros((80, 80))
#: larger than packtune holds per trial, advanced in place by the training forward too
HUGE_RUNNING = torch.zeros(MAX_HELD_LARGE + 1, dtype=torch.float64)


class _Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            RUNNING.add_(1.0)
            RUNNING_ARRAY[:] += 1.0
            HUGE_RUNNING[:16].add_(1.0)
        scale = 1.0 + PROJECTION[0, :16] + 0.01 * RUNNING[0, :16]
        scale = scale + 0.01 * torch.from_numpy(RUNNING_ARRAY[0, :16])
        return self.fc2(torch.relu(self.fc1(x)) * scale)


class LargeInPlace(TinyMLP):
    name = "large-in-place"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        PROJECTION.normal_(std=float(self.resolve(config)["scale"]))
        return _Projected().double()


def test_a_larger_tensor_changed_in_place_is_each_members_own() -> None:
    """6,400 elements, redrawn by each build and advanced by each training step (a tensor and
    a NumPy array): before, none was held per trial, a warning said so (of the tensors), and
    every member read the last build's projection and every step's count. Now each is each
    member's own; only a tensor larger than packtune holds is said to be shared."""

    def zeros() -> None:
        PROJECTION.zero_()
        RUNNING.zero_()
        RUNNING_ARRAY[:] = 0.0

    array = trained_as_alone_from(LargeInPlace(), members([0.1, 0.2]), zeros)
    assert any("build_model set" in n and f"'{__name__}.PROJECTION'" in n for n in array.notes)
    assert any("a training step sets" in n and f"'{__name__}.RUNNING'" in n for n in array.notes)
    unheld = [n for n in array.notes if "too large" in n]
    assert len(unheld) == 1 and f"{__name__}.HUGE_RUNNING in place" in unheld[0], array.notes


RESUME_SCRIPT = """
import importlib
import sys

import torch

from tests.worker.test_outside_state import EPOCHS, members, results
from worker.fused import FusedArray, train

# this module by the name the checkpoints' values were saved under (pytest's, here)
workload = importlib.import_module(sys.argv[3]).LargeInPlace
states = torch.load(sys.argv[1], weights_only=False) if sys.argv[1] != "-" else None
group = members([0.1, 0.2])
resumed = FusedArray(workload(), group, states=states)
train(resumed, EPOCHS * resumed.steps_per_epoch)
torch.save(results(resumed), sys.argv[2])
"""


@pytest.mark.parametrize("resumed", [True, False], ids=["resumed", "first"])
def test_a_larger_tensor_a_step_changes_in_a_new_process(tmp_path: Any, resumed: bool) -> None:
    """In another worker process, a tensor or array only a training step changes is not
    known yet as the builds run (the probe comes after them). Before, a trial resumed there
    had its checkpointed value set in place of the NumPy array (a tensor: the forward's
    from_numpy raised); and in the first array of a process, every member's value was the
    global itself: each member's steps went on from the count the one before it left."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    def zeros() -> None:
        PROJECTION.zero_()
        RUNNING.zero_()
        RUNNING_ARRAY[:] = 0.0

    group = members([0.1, 0.2])
    zeros()
    first = FusedArray(LargeInPlace(), group)
    train(first, first.steps_per_epoch)
    torch.save([first.member_state(key) for key in first.keys], tmp_path / "states.pt")
    zeros()
    straight = FusedArray(LargeInPlace(), group)
    train(straight, EPOCHS * straight.steps_per_epoch)
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    states = str(tmp_path / "states.pt") if resumed else "-"
    paths = [states, str(tmp_path / "out.pt"), LargeInPlace.__module__]
    proc = subprocess.run(
        [sys.executable, str(script), *paths], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    for key, want in results(straight).items():
        assert_as_alone(got[key], want, key)
