"""Values ``build_model`` keeps outside the model: a module global, a class attribute, and
(:mod:`tests.support.held_workloads`) objects changed in place: a dict the model holds, a
settings object, a namespace, a small tensor, a dict of tensors, random generators.

Each worker process has one of each, and every model in it reads them: before, an array's
members all trained with the value of the last one built (declared fusible or not, fused or
in stacks of one), and an array trained beside another read the other's. Each member now
ends exactly as it ends trained alone, and the array says why its members did not fuse.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from tests.support import held_workloads, knobs
from tests.support.held_workloads import HELD
from tests.support.knob_workload import ImportedScaled
from tests.support.tiny_workloads import TinyMLP
from worker.fused import FusedArray, train
from worker.outside_state import kept, namespaces

EPOCHS = 2

#: set by GlobalScaled.build_model per trial, read by its model's forward
SCALE = 1.0


class _GlobalScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * SCALE)


class _ClassScaled(_GlobalScaled):
    factor = 1.0  # set on the class by ClassScaled.build_model per trial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * self.factor)


class Knobs:
    """A plain class of the module, holding a setting (``Knobs.scale``)."""

    scale = 1.0


class _KnobScaled(_GlobalScaled):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)) * Knobs.scale)


class GlobalScaled(TinyMLP):
    """Declares ``scale`` fusible, yet keeps it in a module global."""

    name = "global-scaled"
    params = {**TinyMLP.params, "scale": 1.0}
    fusible = frozenset({"scale"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        global SCALE
        SCALE = float(self.resolve(config)["scale"])
        return _GlobalScaled().double()


class ClassScaled(GlobalScaled):
    name = "class-scaled"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        _ClassScaled.factor = float(self.resolve(config)["scale"])
        return _ClassScaled().double()


class KnobScaled(GlobalScaled):
    name = "knob-scaled"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        Knobs.scale = float(self.resolve(config)["scale"])
        return _KnobScaled().double()


WORKLOADS = [GlobalScaled, ClassScaled, KnobScaled, ImportedScaled, *HELD]
#: the name each workload's note gives its value by
KEPT_AS = {
    "global-scaled": f"{__name__}.SCALE",
    "class-scaled": f"{__name__}._ClassScaled.factor",
    "knob-scaled": f"{__name__}.Knobs.scale",
    "imported-scaled": f"{knobs.__name__}.SCALE",
    "dict-in-place": f"{held_workloads.__name__}.CONFIG",
    "settings-object": f"{held_workloads.__name__}.SETTINGS",
    "options-namespace": f"{held_workloads.__name__}.OPTIONS",
    "factor-tensor": f"{held_workloads.__name__}.FACTOR",
    "factor-array": f"{held_workloads.__name__}.FACTORS",
    "slots-object": f"{held_workloads.__name__}.SLOT_SETTINGS",
    "parts-dict": f"{held_workloads.__name__}.PARTS",
    "seeded-noise": f"{held_workloads.__name__}.NOISE",
    "seeded-coin": f"{held_workloads.__name__}.COIN",
}


def members(scales: list[float], first: int = 0) -> list[tuple[Hashable, dict[str, Any]]]:
    return [
        (f"t{first + i}", {"seed": 30 + first + i, "data_seed": 4, "lr": 0.1, "scale": s,
                           "dtype": "float64"})
        for i, s in enumerate(scales)
    ]  # fmt: skip


def results(array: FusedArray) -> dict[Hashable, tuple[dict[str, Any], dict[str, float]]]:
    """Each member's parameters and evaluation."""
    evaluated = array.evaluate()
    return {key: (array.member_state(key)["params"], evaluated[key]) for key in array.keys}


def alone(workload: Any, member: tuple[Hashable, dict[str, Any]]) -> Any:
    solo = FusedArray(copy.copy(workload), [member])
    train(solo, EPOCHS * solo.steps_per_epoch)
    return results(solo)[member[0]]


def trained_as_alone(w: Any, scales: list[float]) -> FusedArray:
    """An array of members of ``scales`` trained: each ends as it ends trained alone."""
    group = members(scales)
    want = {key: alone(w, (key, config)) for key, config in group}
    array = FusedArray(copy.copy(w), group)
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)
    return array


def assert_as_alone(got: Any, want: Any, key: Hashable) -> None:
    for name, tensor in want[0].items():
        torch.testing.assert_close(got[0][name], tensor, rtol=0, atol=1e-12, msg=f"{key} {name}")
    assert got[1]["val_loss"] == pytest.approx(want[1]["val_loss"], rel=1e-12), key


def trained_as_alone_from(
    w: Any, group: list[tuple[Hashable, dict[str, Any]]], start: Callable[[], None]
) -> FusedArray:
    """Each member of ``group`` trained alone, each from the module's values ``start`` puts
    back (as in a fresh process), then all in one array (from whatever the last left):
    each ends as it ended alone. Returns the array."""
    want = {}
    for member in group:
        start()
        want[member[0]] = alone(w, member)
    array = FusedArray(copy.copy(w), group)
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)
    return array


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_members_with_their_own_values_end_as_trained_alone(workload: type[TinyMLP]) -> None:
    w = workload()
    array = trained_as_alone(w, [0.5, 1.0, 2.0])
    assert [len(keys) for keys, _ in array.stacks] == [1, 1, 1]
    (note,) = [n for n in array.notes if "build_model set" in n and "outside the model" in n]
    assert KEPT_AS[w.name] in note and "one at a time" in note, note


#: workloads whose values are random generators, which never fuse
SEEDED = [held_workloads.SeededNoise, held_workloads.SeededCoin]


@pytest.mark.parametrize(
    "workload", [w for w in WORKLOADS if w not in SEEDED], ids=lambda w: w.name
)
def test_equal_values_still_fuse(workload: type[TinyMLP]) -> None:
    w = workload()
    FusedArray(copy.copy(w), members([3.0]))  # a build of another value first: seen as kept
    group = members([1.5, 1.5, 1.5])
    want = {key: alone(w, (key, config)) for key, config in group}
    array = FusedArray(copy.copy(w), group)
    assert [len(keys) for keys, _ in array.stacks] == [3]
    FusedArray(copy.copy(w), members([4.0], first=9))  # another array built since
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)


class ConstantNoise(held_workloads.SeededNoise):
    """Seeds its generator alike for every trial: each member alone draws the same noise,
    which members stacked together would share (k draws of one stream)."""

    name = "constant-noise"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        model = super().build_model({**config, "seed": 7})
        return model


def test_a_generator_at_equal_states_still_trains_one_member_per_stack() -> None:
    w = ConstantNoise()
    FusedArray(copy.copy(w), members([3.0]))  # a build before: the generator is seen as kept
    group = members([1.5, 1.5, 1.5])
    want = {key: alone(w, (key, config)) for key, config in group}
    array = FusedArray(copy.copy(w), group)
    assert [len(keys) for keys, _ in array.stacks] == [1, 1, 1]
    train(array, EPOCHS * array.steps_per_epoch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.name)
def test_two_arrays_trained_at_once_each_read_their_own_values(workload: type[TinyMLP]) -> None:
    """Each array's members agree, the arrays do not: the second's build changed the value
    the first one's forward reads, and the two train in threads at once, as a pack's do."""
    at_once_as_alone(workload(), [members([0.5, 0.5]), members([2.0, 2.0], first=2)])


def at_once_as_alone(
    w: Any, groups: list[list[tuple[Hashable, dict[str, Any]]]], built_first: bool = False
) -> None:
    """Arrays of ``groups`` (copies of workload ``w``) trained in threads at once, as a
    pack's are: each member ends as it ends trained alone (``built_first``: the arrays
    built before the members alone are)."""
    arrays = [FusedArray(copy.copy(w), group) for group in groups] if built_first else []
    want = {key: alone(w, (key, config)) for group in groups for key, config in group}
    arrays = arrays or [FusedArray(copy.copy(w), group) for group in groups]
    threads = [
        threading.Thread(target=train, args=(array, EPOCHS * array.steps_per_epoch))
        for array in arrays
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for array in arrays:
        for key, got in results(array).items():
            assert_as_alone(got, want[key], key)


def test_builtin_workloads_keep_nothing_outside() -> None:
    """Their steps take no exclusive hold: no namespace of theirs is read at all."""
    from packtune.workloads import get_workload

    for name in ("digits-mlp", "digits-cnn", "synthetic-mlp"):
        w = get_workload(name)
        model = w.build_model(w.resolve({"seed": 0, "data_seed": 0}))
        assert namespaces(w, model) == [], name
        assert kept(namespaces(w, model)) == {}


class NoisyLoss(TinyMLP):
    """Draws from torch's generator in its training loss: its members' steps reseed it.
    (Not in evaluation, whose draws come from wherever the generator stands.)"""

    name = "noisy-loss"
    params = {**TinyMLP.params, "scale": 1.0}  # taken, not read
    fusible = frozenset({"scale"})

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        noise = 0.1 * torch.rand(()) if torch.is_grad_enabled() else 0.0
        return super().loss(outputs, targets) * (1 + noise)


@pytest.mark.parametrize(
    "workload", [GlobalScaled, held_workloads.DictInPlace, NoisyLoss], ids=lambda w: w.name
)
def test_a_memory_probe_beside_a_training_array_leaves_it_alone(workload: type[TinyMLP]) -> None:
    """A pack's array whose fusion key is new probes its memory and speed while the pack's
    other arrays train in other threads. The probe's builds seeded torch's generator (and
    set the scale global) in the middle of the training array's steps; they now wait, as an
    array's builds do."""
    import sys

    from worker.memory import probe

    w = workload()
    group = members([0.5, 2.0])
    want = {key: alone(w, (key, config)) for key, config in group}
    array = FusedArray(copy.copy(w), group)
    done = threading.Event()

    def probing() -> None:
        config = {**members([3.0], first=7)[0][1], "batch_size": 8}
        while not done.is_set():
            probe(copy.copy(w), config, ks=(1, 2), steps=1)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: a race shows within a few steps
    prober = threading.Thread(target=probing)
    prober.start()
    try:
        train(array, EPOCHS * array.steps_per_epoch)
    finally:
        done.set()
        prober.join()
        sys.setswitchinterval(switch)
    for key, got in results(array).items():
        assert_as_alone(got, want[key], key)
