"""Process-wide torch settings ``build_model`` changes for some trials only: the default
dtype (``torch.set_default_dtype(torch.float64)``), deterministic algorithms.

A worker process has one of each, which every model in it computes under. Before, a member
built after one that set the default dtype was built (and trained) in float64 where alone
it is float32, and the setting stayed for every later array of the process. Each member's
build now starts from the process's settings, its own are put back around its steps and
evaluations only, and the process's are left as they were."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.tiny_workloads import TinyMLP
from tests.worker.test_outside_state import EPOCHS, assert_as_alone, results
from worker.fused import FusedArray, train


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.fc1(x.to(self.fc1.weight.dtype))))
        # a tensor made in the forward, of the default dtype (0.1 rounds otherwise in each)
        return out + torch.full((3,), 0.1).to(out.dtype)


class DoubleSome(TinyMLP):
    """Builds in float64 for trials that ask (``double``), by the default dtype; declares
    ``double`` fusible (wrongly: it is not a value a buffer carries)."""

    name = "double-some"
    params = {**TinyMLP.params, "double": False, "dtype": "float32"}
    fusible = frozenset({"double"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        if self.resolve(config)["double"]:
            torch.set_default_dtype(torch.float64)
        return _Net()


def member(i: int, double: bool) -> tuple[str, dict[str, Any]]:
    return f"t{i}", {"seed": 40 + i, "data_seed": 4, "lr": 0.1, "double": double}


def alone(w: Any, m: tuple[str, dict[str, Any]]) -> Any:
    """``m`` trained alone from the process's float32 default."""
    torch.set_default_dtype(torch.float32)
    solo = FusedArray(copy.copy(w), [m])
    train(solo, EPOCHS * solo.steps_per_epoch)
    return results(solo)[m[0]]


@pytest.fixture(autouse=True)
def float32_after() -> Any:
    yield
    torch.set_default_dtype(torch.float32)


def test_a_member_built_after_one_that_set_the_default_dtype_is_built_in_its_own() -> None:
    w = DoubleSome()
    group = [member(0, True), member(1, False), member(2, True)]
    want = {key: alone(w, (key, config)) for key, config in group}
    torch.set_default_dtype(torch.float32)
    array = FusedArray(copy.copy(w), group)
    assert torch.get_default_dtype() == torch.float32  # the process's own, after the builds
    train(array, EPOCHS * array.steps_per_epoch)
    assert torch.get_default_dtype() == torch.float32  # and after its steps
    got = results(array)
    assert torch.get_default_dtype() == torch.float32  # and after its evaluation
    for key, _ in group:
        assert_as_alone(got[key], want[key], key)
    assert got["t1"][0]["fc1.weight"].dtype == torch.float32
    assert got["t0"][0]["fc1.weight"].dtype == torch.float64
    assert any("torch.set_default_dtype" in n for n in array.notes), array.notes


def test_an_array_built_after_one_that_set_the_default_dtype_starts_from_the_processs() -> None:
    w = DoubleSome()
    want = alone(w, member(5, False))
    torch.set_default_dtype(torch.float32)
    FusedArray(copy.copy(w), [member(3, True)])
    array = FusedArray(copy.copy(w), [member(5, False)])
    train(array, EPOCHS * array.steps_per_epoch)
    assert_as_alone(results(array)["t5"], want, "t5")


def test_members_that_set_the_same_still_fuse() -> None:
    w = DoubleSome()
    array = FusedArray(copy.copy(w), [member(i, True) for i in range(3)])
    assert [len(keys) for keys, _ in array.stacks] == [3]
    assert torch.get_default_dtype() == torch.float32


def test_each_setting_is_read_and_put_back() -> None:
    from worker import torch_settings

    before = torch_settings.read()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        after = torch_settings.read()
        own, changed, apart = torch_settings.members_own(before, {"a": after, "b": before})
        # (the matmul precision sets TF32's flag too, which is read as changed)
        assert {"torch.set_float32_matmul_precision", "torch.use_deterministic_algorithms"} <= set(
            changed
        )
        assert apart == changed
        assert own["a"]["torch.set_float32_matmul_precision"] == "medium"
        name = "torch.use_deterministic_algorithms"
        assert own["b"][name] == before[name] != own["a"][name]
        assert torch_settings.members_own(before, {"a": before}) == ({}, [], [])
    finally:
        torch_settings.put(before)
    assert torch_settings.read() == before
    assert not torch.are_deterministic_algorithms_enabled()


class DoubleThenFails(DoubleSome):
    name = "double-then-fails"

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        torch.set_default_dtype(torch.float64)
        raise RuntimeError("out of memory")


def test_a_build_that_fails_leaves_the_processs_settings() -> None:
    """The array is refused (the build's error), and the process goes on with its own
    default dtype: before, float64 stayed, and every later array was built in it."""
    from worker.fused import BuildError

    with pytest.raises(BuildError, match="out of memory"):
        FusedArray(DoubleThenFails(), [member(0, True)])
    assert torch.get_default_dtype() == torch.float32


class MetaDefaultSome(TinyMLP):
    """Sets the default device for trials that ask (``meta``: as one that builds a large
    model's skeleton first does), building its own model on the CPU explicitly."""

    name = "meta-default-some"
    params = {**TinyMLP.params, "meta": False}
    fusible = frozenset({"meta"})

    def build_model(self, config: Mapping[str, Any]) -> nn.Module:
        if self.resolve(config)["meta"]:
            torch.set_default_device("meta")
            with torch.device("cpu"):
                return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def test_a_member_built_after_one_that_set_the_default_device_is_built_on_the_processs() -> None:
    """Before, the second member's model was built on the meta device the first one's build
    had left as the default: it could not train, and neither could any later array."""
    w = MetaDefaultSome()
    first = ("t0", {"seed": 40, "data_seed": 4, "lr": 0.1, "meta": True})
    second = ("t1", {"seed": 41, "data_seed": 4, "lr": 0.1, "meta": False})
    third = ("t2", {**second[1], "seed": 42})
    want, want_later = alone(w, second), alone(w, third)
    try:
        array = FusedArray(copy.copy(w), [first, second])
        assert torch.get_default_device() == torch.device("cpu")
        train(array, EPOCHS * array.steps_per_epoch)
        assert torch.get_default_device() == torch.device("cpu")
        assert_as_alone(results(array)["t1"], want, "t1")
        later = FusedArray(copy.copy(w), [third])  # a later array of the process
        train(later, EPOCHS * later.steps_per_epoch)
        assert_as_alone(results(later)["t2"], want_later, "t2")
    finally:
        torch.set_default_device(None)


def test_a_build_that_fails_leaves_the_processs_host_random_state() -> None:
    """Python's and NumPy's global generators as the process had them: before, a failed
    build left them seeded from its trial's seed."""
    import random

    import numpy

    from worker.fused import BuildError

    random.seed(123)
    numpy.random.seed(123)
    want = (random.random(), float(numpy.random.random()))
    random.seed(123)
    numpy.random.seed(123)
    with pytest.raises(BuildError, match="out of memory"):
        FusedArray(DoubleThenFails(), [member(0, True)])
    assert (random.random(), float(numpy.random.random())) == want
