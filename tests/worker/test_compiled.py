"""Compiled training steps (torch.compile) train every member as the eager step does, to
float rounding: schedules, clipping and divergence included; a failed compilation trains
eagerly from the same state; later arrays reuse a compiled step. And the other device
settings for speed: TF32."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import pytest
import torch

from packtune.settings import Settings
from packtune.workloads.base import Workload
from tests.support.states import assert_member_states_close
from tests.support.tiny_workloads import Ramp, TinyCNN, TinyMLP
from worker import compiled
from worker.fused import FusedArray, Report, train
from worker.workloads.parts import stacked_cross_entropy

EPOCHS = 2


@pytest.fixture(autouse=True)
def fresh_steps():
    compiled.reset()
    yield
    compiled.reset()


@pytest.fixture
def traced_only(monkeypatch):
    """torch's ``aot_eager`` backend in inductor's place: the same tracing, guards, shapes
    and autograd, no code generation (seconds per compilation less), for the tests of how
    compiled steps are kept and reused rather than of the generated code's numbers."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")


def mlp_members() -> list[tuple[Hashable, dict[str, Any]]]:
    """An MLP with BatchNorm, SGD with momentum: a cosine schedule with warm-up, clipping of
    some members, and one member whose learning rate makes it diverge."""
    lrs, clips = [0.05, 0.1, 0.2, 1e300], [0.0, 0.5, 0.0, 0.0]
    return [
        (f"m{i}", {"seed": 5 + i, "data_seed": 2, "batch_norm": True, "lr": lr, "clip_norm": clip,
                   "schedule": "cosine", "warmup_epochs": 0.5, "decay_epochs": EPOCHS})
        for i, (lr, clip) in enumerate(zip(lrs, clips, strict=True))
    ]  # fmt: skip


def cnn_members() -> list[tuple[Hashable, dict[str, Any]]]:
    """A CNN with BatchNorm2d (a vmap stack in auto mode), SGD with momentum and a step
    schedule (under Adam its Conv2d bias, which the BatchNorm cancels, has a gradient of
    float rounding: the members would train one at a time, worker.probe.rounding_noise)."""
    return [
        (f"c{i}", {"seed": 9 + i, "data_seed": 4, "batch_norm": True, "optimizer": "sgd",
                   "momentum": 0.9, "lr": lr, "schedule": "step", "decay_epochs": 1,
                   "gamma": 0.5})
        for i, lr in enumerate([0.01, 0.03, 0.1])
    ]  # fmt: skip


def run(
    workload: Workload, members: list[tuple[Hashable, dict[str, Any]]], **kwargs: Any
) -> tuple[FusedArray, list[Report]]:
    array = FusedArray(workload, members, **kwargs)
    return array, train(array, EPOCHS * array.steps_per_epoch)


def assert_same_training(
    eager: tuple[FusedArray, list[Report]], other: tuple[FusedArray, list[Report]]
) -> None:
    (want, want_reports), (got, got_reports) = eager, other
    assert got.keys == want.keys and got.diverged == want.diverged
    for a, b in zip(want_reports, got_reports, strict=True):
        assert (a.step, a.diverged) == (b.step, b.diverged)
        for key, metrics in a.metrics.items():
            assert b.metrics[key] == pytest.approx(metrics, rel=1e-9, nan_ok=True)
    for key in want.keys:
        assert_member_states_close(want.member_state(key), got.member_state(key))


@pytest.mark.parametrize(
    ("workload", "members", "mode"),
    [(TinyMLP(), mlp_members(), "bmm"), (TinyCNN(), cnn_members(), "vmap")],
    ids=["mlp-bmm", "cnn-vmap"],
)
def test_a_compiled_step_trains_every_member_as_the_eager_step(workload, members, mode):
    eager = run(workload, members)
    got = run(workload, members, compile_step=True)
    array = got[0]
    assert array.mode == mode and all(group.compiled is not None for group in array.groups)
    assert array.notes == []
    assert_same_training(eager, got)
    if workload.name == "tiny-mlp":
        assert list(array.diverged) == ["m3"]  # diverged alone; the others as eager


def test_a_later_array_of_the_same_structure_reuses_the_compiled_step(traced_only):
    workload, members = TinyMLP(), mlp_members()[:3]
    first, _ = run(workload, members, compile_step=True)
    frames = dict(torch._dynamo.utils.counters["stats"])
    other = [(f"o{i}", {**config, "seed": 40 + i}) for i, (_, config) in enumerate(members)]
    second, _ = run(workload, other, compile_step=True)
    assert second.groups[0].compiled is first.groups[0].compiled
    # no new graph: the guards of the first array's compilation hold for the second's
    assert dict(torch._dynamo.utils.counters["stats"]) == frames


def test_each_step_key_compiles_within_a_budget_of_its_own(monkeypatch, traced_only):
    """Issue: torch keeps compiled variants per code object, and every key's losses function
    shared one (closures of one ``def``): past 8 variants in all (array sizes, batch shapes,
    workloads) a worker's later steps ran eagerly, silently but for a log line."""
    monkeypatch.setattr(compiled, "RECOMPILE_LIMIT", 1)
    stats = torch._dynamo.utils.counters["stats"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for workload, members in ((TinyMLP(), mlp_members()[:2]), (TinyCNN(), cnn_members()[:2])):
            before = stats["unique_graphs"]
            array = FusedArray(workload, members, compile_step=True)
            array.train_step(next(iter(workload.batch_indices(array.config, 0))))
            assert stats["unique_graphs"] > before, f"{workload.name}'s step was not compiled"


class StackedTinyMLP(TinyMLP):
    """TinyMLP with its losses in one call (``stacked_loss``), as the built-in workloads."""

    name = "tiny-mlp-stacked"

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return stacked_cross_entropy(outputs, targets)


def test_array_sizes_after_the_second_reuse_its_dynamic_compilation(traced_only):
    """Hyperband's rungs give every size from 27 down to 2: a compilation per size would cost
    seconds each. The second size compiles with the size symbolic; the third compiles
    nothing and trains as the eager step does. (A workload whose losses take a Python loop
    or vmap over the members, with no ``stacked_loss``, compiles per size.)"""
    workload, members = StackedTinyMLP(), mlp_members()[:3]
    stats = torch._dynamo.utils.counters["stats"]
    for k in (3, 2):
        array = FusedArray(workload, members[:k], compile_step=True)
        array.train_step(next(iter(workload.batch_indices(array.config, 0))))
    before = stats["unique_graphs"]
    more = [(f"x{i}", {**config, "seed": 70 + i}) for i, (_, config) in enumerate(members)]
    more.append(("x3", {**more[0][1], "seed": 74, "lr": 0.03}))
    eager, got = run(workload, more), run(workload, more, compile_step=True)  # k = 4
    assert stats["unique_graphs"] == before
    assert_same_training(eager, got)


def test_an_array_evaluating_leaves_another_arrays_compiled_step_in_train_mode(
    traced_only,
):
    workload, members = TinyMLP(), mlp_members()[:3]
    first = FusedArray(workload, members, compile_step=True)
    first.groups[0].template.eval()  # as while it evaluates, in another thread
    eager = run(workload, members)
    assert_same_training(eager, run(workload, members, compile_step=True))


def test_a_step_that_fails_to_compile_trains_eagerly_from_the_same_state(monkeypatch, caplog):
    def failing(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        raise RuntimeError("this backend compiles nothing")

    monkeypatch.setattr(compiled, "BACKEND", failing)
    workload, members = TinyCNN(), cnn_members()
    eager = run(workload, members)
    with caplog.at_level(logging.WARNING, logger="worker.compiled"):
        got = run(workload, members, compile_step=True)
        again = run(workload, members, compile_step=True)
    assert_same_training(eager, got)
    assert_same_training(eager, again)
    for array, _ in (got, again):
        assert all(group.compiled is None for group in array.groups)
    # tried again with fixed shapes, then eager
    assert [note.split(" (")[0] for note in got[0].notes] == [
        "tiny-cnn: the compiled step failed",
        "tiny-cnn: the compiled step failed with fixed shapes",
    ]
    assert all("this backend compiles nothing" in note for note in got[0].notes)
    assert again[0].notes == []  # the failure is known: the next array does not try again
    warnings = [r for r in caplog.records if "compiled step failed" in r.getMessage()]
    assert len(warnings) == 2  # once per outcome


def test_a_compilation_after_a_member_leaves_is_guarded_too(monkeypatch):
    """A member that diverges leaves the stack, so the next step has another array size and
    compiles again, at a batch shape that has run before: that compilation may fail too,
    and the array then goes on eagerly instead of failing its trials."""
    calls = []

    def first_only(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        calls.append(len(calls))
        if len(calls) > 1:
            raise RuntimeError("the second compilation fails")
        return graph.forward

    monkeypatch.setattr(compiled, "BACKEND", first_only)
    workload, members = TinyMLP(), mlp_members()  # m3 diverges in its first steps
    eager = run(workload, members)
    got = run(workload, members, compile_step=True)
    # the second: the recompilation for the new size (symbolic); then one with fixed shapes
    assert len(calls) == 3 and list(got[0].diverged) == ["m3"]
    assert [note.split(" (")[0] for note in got[0].notes] == [
        "tiny-mlp: the compiled step failed",
        "tiny-mlp: the compiled step failed with fixed shapes",
    ]
    assert all("the second compilation fails" in note for note in got[0].notes)
    assert_same_training(eager, got)


def test_a_key_whose_symbolic_recompilation_fails_compiles_per_shape(monkeypatch):
    """vmap's convolution rule could not compile with a symbolic array size (digits-cnn:
    "cannot determine truth value of Relational"): the key then compiles each size with
    fixed shapes instead of training eagerly, and other keys are not affected."""

    def fixed_only(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        if any(isinstance(i, torch.SymInt) for i in inputs):
            raise TypeError("cannot determine truth value of Relational")
        return graph.forward

    monkeypatch.setattr(compiled, "BACKEND", fixed_only)
    workload, members = StackedTinyMLP(), mlp_members()[:3]
    first = FusedArray(workload, members, compile_step=True)
    first.train_step(next(iter(workload.batch_indices(first.config, 0))))
    eager, got = run(workload, members[:2]), run(workload, members[:2], compile_step=True)
    assert got[0].groups[0].compiled is not None  # k=2, with fixed shapes
    assert got[0].notes == [
        "tiny-mlp-stacked: the compiled step failed (TypeError: cannot determine truth value "
        "of Relational); it compiles again with fixed shapes"
    ]
    assert_same_training(eager, got)
    # Another key (same parameter names) starts with fixed shapes: torch tracks which sizes
    # changed per function name, and each key's function has a name of its own (before,
    # this key's first compilation was symbolic and failed here too).
    other = [(key, {**config, "batch_norm": False}) for key, config in members]
    fresh = FusedArray(workload, other, compile_step=True)
    fresh.train_step(next(iter(workload.batch_indices(fresh.config, 0))))
    assert fresh.notes == [] and fresh.groups[0].compiled is not None


def test_random_draws_and_spilled_stacks_stay_eager():
    members = [(f"d{i}", {"seed": i, "data_seed": 1, "dropout": 0.2}) for i in range(2)]
    dropout = FusedArray(TinyMLP(), members, compile_step=True)
    assert dropout.groups and all(group.compiled is None for group in dropout.groups)
    spilled = FusedArray(TinyMLP(), mlp_members()[:2], compile_step=True, spill_budget=10**6)
    assert all(group.compiled is None for group in spilled.groups)


def test_the_compile_settings_name_their_values(monkeypatch):
    assert Settings().compile_step == "off"
    monkeypatch.setenv("PACKTUNE_COMPILE_STEP", "on")
    monkeypatch.setenv("PACKTUNE_COMPILE_MODE", "max-autotune-no-cudagraphs")
    settings = Settings()
    assert (settings.compile_step, settings.compile_mode) == ("on", "max-autotune-no-cudagraphs")
    assert compiled.compile_mode(torch.device("cuda"), None) == "reduce-overhead"
    assert compiled.compile_mode(torch.device("cpu"), None) == "default"
    monkeypatch.setenv("PACKTUNE_COMPILE_MODE", "fastest")
    with pytest.raises(ValueError, match="compile_mode"):
        Settings()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_a_compiled_step_on_a_gpu_trains_as_the_eager_step(mode):
    """On a GPU, CUDA graphs (reduce-overhead) and plain compilation, float32: the same
    training to float32 rounding, the diverging member dropped alone."""
    workload = TinyMLP()
    members = [(key, {**config, "dtype": "float32"}) for key, config in mlp_members()]
    (want, want_reports), (got, got_reports) = (
        run(workload, members, device="cuda"),
        run(workload, members, device="cuda", compile_step=True, compile_mode=mode),
    )
    assert all(group.compiled is not None for group in got.groups) and got.notes == []
    assert got.keys == want.keys and got.diverged == want.diverged
    for a, b in zip(want_reports, got_reports, strict=True):
        for key, metrics in a.metrics.items():
            assert b.metrics[key] == pytest.approx(metrics, rel=1e-4, nan_ok=True)
    for key in want.keys:
        for name, t in want.member_state(key)["params"].items():
            torch.testing.assert_close(got.member_state(key)["params"][name], t,
                                       rtol=1e-4, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("setting", [None, "true", "false"])
def test_a_worker_sets_tf32_as_its_setting_says(clean_env, setting):
    from packtune.settings import get_settings
    from worker.jobs import pick_device

    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    threads = torch.get_num_threads()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    try:
        clean_env.setenv("PACKTUNE_DEVICE", "cpu")
        if setting is not None:
            clean_env.setenv("PACKTUNE_TF32", setting)
        get_settings.cache_clear()
        pick_device()
        flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        want = {None: (False, True), "true": (True, True), "false": (False, False)}[setting]
        assert flags == want  # unset: torch's defaults (convolutions TF32, matmuls not)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        torch.set_num_threads(threads)
        get_settings.cache_clear()


class _RampMLP(TinyMLP):
    name = "ramp-mlp"

    def build_model(self, config: Any) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), Ramp(4), torch.nn.Linear(16, 3)
        ).double()


def test_a_forward_keeping_python_state_trains_eagerly_as_unpacked(traced_only):
    """A compiled step's one template served every array of its key: a counter a forward
    keeps on a module advanced for all of them, and evaluation read the stacks' own,
    unmoved counters (found by an audit: val_accuracy 0.10 against 0.147 eager). The first
    compiled step now sees the change, keeps it for its stack and trains eagerly on."""
    workload, members = _RampMLP(), mlp_members()[:3]
    for _, config in members:
        config.pop("batch_norm")
    eager = run(workload, members)
    got = run(workload, members, compile_step=True)
    assert got[0].mode == "vmap" and all(group.compiled is None for group in got[0].groups)
    assert any("Python attributes of its modules ('2.calls')" in n for n in got[0].notes)
    assert_same_training(eager, got)
    # a later array of the key in this process: eager at once, from its own counter
    later = run(workload, members[:1], compile_step=True)
    assert_same_training(run(workload, members[:1]), later)


def test_two_arrays_built_before_the_check_both_train_eagerly_as_unpacked(traced_only):
    """Two arrays of the key built (as a pack's arrays in threads are) before either
    stepped: the first one's step refused the key, and the second, already holding the
    compiled step, trained on with the shared template (found by a review)."""
    workload, members = _RampMLP(), mlp_members()[:2]
    for _, config in members:
        config.pop("batch_norm")
    first = FusedArray(workload, members[:1], compile_step=True)
    second = FusedArray(workload, members[1:], compile_step=True)
    got = [(a, train(a, EPOCHS * a.steps_per_epoch)) for a in (first, second)]
    for (array, reports), one in zip(got, (members[:1], members[1:]), strict=True):
        assert all(group.compiled is None for group in array.groups)
        assert_same_training(run(workload, one), (array, reports))


class _Smoothed(TinyMLP):
    """A structural label smoothing its build_model keeps on the workload for its loss."""

    name = "smoothed-tiny"
    params = {**TinyMLP.params, "smoothing": 0.0}
    structural = TinyMLP.structural | {"smoothing"}

    def build_model(self, config: Any) -> torch.nn.Module:
        self.smoothing = float(self.resolve(config)["smoothing"])
        return super().build_model(config)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, targets, label_smoothing=self.smoothing)

    def stacked_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        return None


def test_a_later_array_whose_workload_holds_other_values_gets_a_compiled_step_of_its_own(
    traced_only,
):
    """Each array has its own copy of the workload; the compiled step read the copy of the
    array that made it, so a later array of the key trained with the first one's label
    smoothing (found by a review). Each set of such values now has a step of its own."""
    workload = _Smoothed()
    plain = [(f"s{i}", {"seed": i, "data_seed": 1, "lr": 0.1}) for i in range(2)]
    smoothed = [(key, {**config, "smoothing": 0.6}) for key, config in plain]
    run(workload, plain, compile_step=True)
    got = run(workload, smoothed, compile_step=True)
    assert all(group.compiled is not None for group in got[0].groups)
    assert_same_training(run(workload, smoothed), got)
    again = run(workload, plain, compile_step=True)  # the first values' step, reused
    assert_same_training(run(workload, plain), again)


def test_the_python_state_check_sees_changes_and_nothing_else() -> None:
    """Values were deep-copied and compared with ``==``: an object without ``__eq__``, a
    NumPy array and an LSTM's list of flat weights read as changed with nothing run, and
    sent such models eager with a wrong note (found by a review)."""
    import numpy

    from worker.module_state import changed_state, python_state

    class Config:
        scale = 2.0

    class Mine(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 4)
            self.cfg, self.table, self.calls = Config(), numpy.arange(3.0), 0
            self.history: list[float] = []

    model = Mine()
    before = python_state(model)
    assert changed_state(before, python_state(model)) == []
    model.calls += 1
    model.history.append(0.5)  # a plain list changed in place: seen
    model.cfg = Config()  # another object in its place: seen
    assert changed_state(before, python_state(model)) == ["calls", "cfg", "history"]
