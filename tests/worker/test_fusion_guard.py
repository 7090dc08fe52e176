"""Fusion never trains the wrong model: structural unless declared fusible, a guard at
array build time that stacks apart members whose models differ in more than tensor values,
and a vmap stack that cannot run the model's code (in training or in evaluation) going on one
member at a time, as unpacked."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from packtune.space import fusion_key
from packtune.workloads import get_workload
from packtune.workloads.base import OPTIMIZER_HYPER, Workload
from tests.support.plugins.trap_workloads import (
    EvalItemMLP,
    HiddenActMLP,
    HorizonOrderMLP,
    MisdeclaredMLP,
    ScaledMLP,
    SideEffectMLP,
)
from tests.support.tiny_workloads import TinyMLP
from worker.fused import FusedArray, train
from worker.fusion_guard import model_signature, partition, split_causes

EPOCHS = 2


def member(key: str, seed: int, **config: Any) -> tuple[Hashable, dict[str, Any]]:
    return key, {"seed": seed, "data_seed": 4, "lr": 0.1, **config}


def trained(workload: Workload, members: list[tuple[Hashable, dict[str, Any]]]) -> FusedArray:
    array = FusedArray(workload, members)
    train(array, EPOCHS * array.steps_per_epoch)
    return array


def assert_as_alone(workload: Workload, array: FusedArray, members: list[Any]) -> None:
    """Every member's parameters equal those of the same trial trained in an array of one,
    and so do the Python values its training changes (a step counter)."""
    for key, config in members:
        alone = trained(workload, [(key, config)]).member_state(key)
        mine = array.member_state(key)
        assert mine.get("python") == alone.get("python"), key
        for name, tensor in alone["params"].items():
            torch.testing.assert_close(
                mine["params"][name],
                tensor,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m, k=key, n=name: f"{k} {n}: {m}",
            )


def stacks(array: FusedArray) -> list[list[Hashable]]:
    return [list(group.keys) for group in array.groups]


def test_a_parameter_missing_from_structural_is_structural() -> None:
    workload = HiddenActMLP()
    assert "act" in workload.structural_params()
    assert workload.fusible_params() == frozenset(OPTIMIZER_HYPER)
    relu, tanh = ({**workload.resolve({"act": act})} for act in ("relu", "tanh"))
    keys = {fusion_key(workload.name, c, workload.structural_params()) for c in (relu, tanh)}
    assert len(keys) == 2  # never planned into one array
    described = workload.describe()
    assert "act" in described["structural"] and described["fusible"] == sorted(OPTIMIZER_HYPER)


def test_a_structural_declaration_wins_over_a_fusible_one() -> None:
    class Both(ScaledMLP):
        structural = frozenset({"scale", "lr"})

    assert {"scale", "lr"} <= Both().structural_params()
    assert not {"scale", "lr"} & Both().fusible_params()


def test_builtin_members_differing_in_fusible_values_have_equal_models() -> None:
    """The built-ins keep fusing: seed and optimizer values leave the signature alone, a
    structural value changes it."""
    small = {
        "resnet-cifar": {"width": 4, "n_train": 64, "n_val": 32},
        "synthetic-mlp": {"n_train": 256},
    }
    changed = {
        "digits-mlp": {"activation": "tanh"},
        "digits-cnn": {"channels": 8},
        "synthetic-mlp": {"hidden": 64},
        "resnet-cifar": {"blocks": 2},
    }
    for name, change in changed.items():
        workload = get_workload(name)
        base = {**small.get(name, {})}
        signatures = []
        for seed, lr, config in ((1, 0.1, base), (2, 0.5, base), (1, 0.1, {**base, **change})):
            torch.manual_seed(seed)
            signatures.append(model_signature(workload.build_model({**config, "lr": lr})))
        assert signatures[0] == signatures[1], name
        assert signatures[0] != signatures[2], name


def test_fusible_declared_but_built_as_a_python_value_is_stacked_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    workload = MisdeclaredMLP()
    members = [
        member("a", 1, act="relu"),
        member("b", 2, act="tanh"),
        member("c", 3, act="relu", lr=0.3),
    ]
    with caplog.at_level(logging.WARNING, logger="worker.fused"):
        array = trained(workload, members)
    assert stacks(array) == [["a", "c"], ["b"]]
    assert array.warning is not None and "'act'" in array.warning
    assert "'act'" in caplog.text and "misdeclared-mlp" in caplog.text
    assert_as_alone(workload, array, members)
    # not vacuous: the tanh trial trained as the relu template would have ended elsewhere
    as_relu = trained(workload, [member("b", 2, act="relu")]).member_state("b")
    mine = array.member_state("b")
    assert not torch.allclose(mine["params"]["fc1.weight"], as_relu["params"]["fc1.weight"])


def test_classes_made_per_call_fuse_when_their_code_and_closures_agree() -> None:
    workload = MisdeclaredMLP()
    members = [member("a", 1, act="tanh"), member("b", 2, act="tanh", lr=0.02)]
    array = trained(workload, members)
    assert stacks(array) == [["a", "b"]] and array.warning is None and array.mode == "vmap"
    assert_as_alone(workload, array, members)


def test_a_fusible_parameter_carried_as_a_buffer_fuses_exactly() -> None:
    workload = ScaledMLP()
    members = [
        member(k, i, scale=s) for i, (k, s) in enumerate({"a": 0.5, "b": 1.0, "c": 2.0}.items())
    ]
    array = trained(workload, members)
    assert stacks(array) == [["a", "b", "c"]] and array.warning is None
    assert_as_alone(workload, array, members)
    evaluated = array.evaluate()
    assert len({round(m["val_loss"], 6) for m in evaluated.values()}) == 3


def test_dropout_trials_train_as_if_alone_in_auto_mode() -> None:
    """A member of a hand-fusable model whose only draws are its Dropout modules' draws its
    masks from its own stream, in one fused stack: exactly what it draws alone."""
    workload = TinyMLP()
    members = [member(k, i, dropout=0.5) for i, k in enumerate("abc")]
    array = trained(workload, members)
    assert array.mode == "bmm" and not array.stochastic
    assert all(group.stack.streams is not None for group in array.groups)
    assert_as_alone(workload, array, members)
    assert not [n for n in array.notes if "draws random numbers" in n]


class _NoisyDropoutMLP(TinyMLP):
    """Dropout modules and noise added to the input in the workload's own step."""

    def training_loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.loss(model(x + 0.5 * torch.randn_like(x)), y)

    def validation_metrics(self, model: Any, batch: Any) -> dict[str, Any]:
        x, y = batch
        return {"val_loss": self.loss(model(x), y)}


def test_dropout_beside_other_draws_trains_one_member_per_stack() -> None:
    """Draws beside the Dropout modules' (noise in the loss) come from torch's generator,
    which a fused stack's members would share: one member per stack, as unpacked, and
    the note says why."""
    workload = _NoisyDropoutMLP()
    members = [member(k, i, dropout=0.5) for i, k in enumerate("abc")]
    array = trained(workload, members)
    assert array.mode == "serial" and array.stochastic
    assert all(group.stack.streams is None for group in array.groups)
    assert_as_alone(workload, array, members)
    # and says why (docs/workloads.md: `serial x1; ...`, "the warning says which")
    (note,) = [n for n in array.notes if "draws random numbers" in n]
    assert "its members train one at a time, as unpacked" in note


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class _Offset(nn.Module):
    def __init__(self, offset: torch.Tensor) -> None:
        super().__init__()
        self.offset = offset  # a plain attribute: not stacked, so its value counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


@pytest.mark.parametrize(
    "make",
    [
        lambda v: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1 * v)),
        lambda v: nn.Sequential(nn.Linear(4, 4), nn.LeakyReLU(0.01 * v)),
        lambda v: nn.Sequential(nn.Linear(4, 4), _Scale(float(v))),
        lambda v: nn.Sequential(nn.Linear(4, 4), _Offset(torch.full((4,), float(v)))),
        lambda v: nn.Sequential(nn.Linear(4, 4), nn.ReLU() if v == 1 else nn.Tanh()),
        lambda v: nn.Sequential(*[nn.Linear(4, 4) for _ in range(v)]),
        lambda v: nn.Sequential(nn.Linear(4, 4, bias=v == 1)),
    ],
    ids=["dropout-rate", "slope", "float-attribute", "tensor-attribute", "class", "depth", "bias"],
)
def test_the_signature_sees_what_stacking_would_hide(make: Any) -> None:
    assert model_signature(make(1)) == model_signature(make(1))
    assert model_signature(make(1)) != model_signature(make(2))


def test_the_signature_sees_hooks() -> None:
    def hooked(scale: float) -> nn.Module:
        model = nn.Linear(3, 3)
        model.register_forward_hook(lambda m, i, out: out * scale)
        return model

    assert model_signature(hooked(1.0)) == model_signature(hooked(1.0))
    assert model_signature(hooked(1.0)) != model_signature(hooked(2.0))


def test_an_attribute_it_cannot_compare_is_taken_as_different() -> None:
    def with_object() -> nn.Module:
        model = nn.Linear(2, 2)
        model.helper = object()  # identity only: cannot be shown equal
        return model

    assert model_signature(with_object()) != model_signature(with_object())


def test_a_model_that_depends_on_the_seed_is_named_as_such() -> None:
    class SeedWidth(ScaledMLP):
        name = "seed-width"
        fusible = frozenset()

        def build_model(self, config: Mapping[str, Any]) -> Any:
            return nn.Linear(64, 10 + int(config["seed"]) % 2)

    configs = [{"seed": 1, "lr": 0.1}, {"seed": 2, "lr": 0.1}]
    models = [SeedWidth().build_model(c) for c in configs]
    parts = partition([model_signature(m) for m in models])
    assert parts == [[0], [1]]
    assert split_causes(configs, parts) == ["seed"]
    # an optimizer hyperparameter packtune carries per member is not named over the seed
    # (it was: "parameter 'lr'" for a model that depends on the seed)
    configs[1]["lr"] = 0.2
    assert split_causes(configs, parts) == ["seed"]


def test_the_parameter_a_model_is_built_from_is_named_not_the_optimizers() -> None:
    """Members of one each per stack differ in every key that differs: the warning named
    'lr', 'max_epochs' and 'temperature' (an audit's model keeping its fusible temperature
    as a plain tensor attribute), of which only the last shapes the model."""
    configs = [
        {"seed": 1, "lr": 0.1, "max_epochs": 3, "temperature": 1.0},
        {"seed": 2, "lr": 0.2, "max_epochs": 9, "temperature": 2.0},
    ]
    assert split_causes(configs, [[0], [1]]) == ["temperature"]
    assert split_causes([{**c, "temperature": 1.0} for c in configs], [[0], [1]]) == ["seed"]
    same_seed = [{**c, "seed": 1, "temperature": 1.0} for c in configs]
    assert split_causes(same_seed, [[0], [1]]) == ["lr", "max_epochs"]


def test_a_model_that_cannot_be_built_names_the_parameter() -> None:
    """A workload without bounds asked for 2**70 hidden units: the trial's error says so."""

    class Unbounded(HiddenActMLP):
        name = "unbounded"
        bounds: dict[str, tuple[float, float]] = {}

    with pytest.raises(
        ValueError, match=r"could not build the model of hidden=1180591620717411303424"
    ):
        FusedArray(Unbounded(), [member("a", 1, hidden=2**70)])


def test_the_check_fails_a_workload_whose_batches_follow_the_horizon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trials of studies of different ``max_resource`` share arrays, so the check gives its
    members different horizons: a batch order that follows ``max_epochs`` trains fused
    members on other batches than alone, and the check says so; the same model with the
    contract's order passes."""
    from packtune.workloads import registry
    from worker.check import check

    monkeypatch.setitem(registry(), HorizonOrderMLP.name, HorizonOrderMLP())
    report = check(HorizonOrderMLP.name, members=2, steps=3, ks=(1,))
    assert not report.exact and not report.ok, report.max_difference
    assert check("digits-mlp", members=2, steps=3, ks=(1,)).ok


def test_the_check_names_a_fusible_parameter_the_data_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check trained each member "alone" on the first member's data, so a parameter
    declared fusible but read by ``data()`` passed as exact (max difference 0.0; alone, the
    members end 5-9% apart). Each alone member now trains on its own data, and the report
    names the parameter, as the service trains such members apart."""
    from packtune.workloads import registry
    from tests.support.plugins.trap_workloads import DataScaledMLP
    from worker.check import check

    monkeypatch.setitem(registry(), DataScaledMLP.name, DataScaledMLP())
    space = {"input_scale": {"type": "uniform", "low": 0.5, "high": 2.0}}
    report = check(DataScaledMLP.name, space, members=2, steps=3, ks=(1,))
    assert not report.exact and not report.ok, report.max_difference
    assert any("reads 'input_scale'" in warning for warning in report.warnings)


def test_the_check_of_a_model_that_draws_after_a_warm_up_trains_it_as_the_service_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model that begins to draw after its probe: the check's fused array stops at the
    draw, as the service's does, and trains again knowing; its report says why and is
    exact (before, the fused members shared one stream and the check said NOT exact,
    while the service trained them fused anyway)."""
    from packtune.workloads import registry
    from tests.support.plugins.trap_workloads import LateNoiseMLP
    from worker.check import check

    workload = LateNoiseMLP()
    workload.name = "late-noise-check"  # this process has not learned it yet
    monkeypatch.setitem(registry(), workload.name, workload)
    report = check(workload.name, members=2, steps=30, ks=(1,))
    assert report.exact and report.ok, (report.max_difference, report.warnings)
    assert any("had not seen" in warning for warning in report.warnings), report.warnings


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_gradients_that_are_float_rounding_train_apart_under_an_optimizer_that_scales_them(
    optimizer: str,
) -> None:
    """A Linear followed by a BatchNorm, stacked through vmap, trained with Adam (or
    RMSprop): the bias's gradient is what rounding leaves of zero, Adam turns it into full
    steps, and vmap rounds otherwise than one model, so fused members ended up to 3% apart
    from their unpacked runs (parameters 0.06 apart after 50 steps). The probe sees such
    gradients; the members train one at a time, as unpacked, and the array says why."""
    from tests.support.plugins.trap_workloads import BatchNormMLP

    workload = BatchNormMLP()
    members = [member(f"t{i}", 60 + i, lr=0.002 * (i + 1), optimizer=optimizer)
               for i in range(3)]  # fmt: skip
    array = trained(workload, members)
    assert [group.mode for group in array.groups] == ["serial"] * 3
    note = next(n for n in array.notes if "are float rounding" in n)
    assert "'net.0.bias'" in note and "'net.3.bias'" in note, note
    assert_as_alone(workload, array, members)


def test_the_key_bias_of_multihead_attention_is_float_rounding_a_third_of_one_tensor() -> None:
    """nn.MultiheadAttention keeps the query's, key's and value's biases in one tensor; the
    key's third only shifts each query's scores alike, which the softmax cancels. Judged as
    a whole the tensor's gradient had a meaning, and under Adam the fused members ended
    apart from alone (2.6e-2 relative, 1e-2 absolute after two epochs); judged element by
    element, as Adam steps, it is rounding, and they train one at a time."""
    from tests.support.plugins.trap_workloads import AttentionMLP

    workload = AttentionMLP()
    members = [member(f"a{i}", 80 + i, lr=0.003 * (i + 1), optimizer="adam") for i in range(3)]
    array = trained(workload, members)
    assert [group.mode for group in array.groups] == ["serial"] * 3
    note = next(n for n in array.notes if "are float rounding" in n)
    assert "'attn.in_proj_bias'" in note, note
    assert_as_alone(workload, array, members)


def test_a_batch_norm_model_without_those_biases_fuses_under_adam() -> None:
    """What the note advises (bias=False before a BatchNorm) fuses, exact: the probe judges
    rounding on a whole batch, not on its first few examples, where an input equal in all of
    them is cancelled by the BatchNorm too (it named the first Linear's weight then)."""
    from tests.support.plugins.trap_workloads import BatchNormMLP

    workload = BatchNormMLP()
    members = [member(f"n{i}", 90 + i, lr=0.002 * (i + 1), optimizer="adam", bias=False)
               for i in range(3)]  # fmt: skip
    array = trained(workload, members)
    assert [group.mode for group in array.groups] == ["vmap"], array.notes
    assert_as_alone(workload, array, members)


def test_under_sgd_a_gradient_of_float_rounding_still_fuses() -> None:
    """SGD steps by such a gradient, ~1e-8 of the weights: the members fuse (vmap), exact."""
    from tests.support.plugins.trap_workloads import BatchNormMLP

    workload = BatchNormMLP()
    members = [member(f"s{i}", 70 + i, lr=0.05 * (i + 1), momentum=0.9) for i in range(3)]
    array = trained(workload, members)
    assert [group.mode for group in array.groups] == ["vmap"]
    assert_as_alone(workload, array, members)


def test_the_probe_names_only_the_gradients_that_are_float_rounding() -> None:
    """The cancelled biases, and nothing of the built-in models (every other gradient moves
    by ~1e-6 when the weights move by a rounding error; resnet-cifar's by 1e-3 at most)."""
    from tests.support.plugins.trap_workloads import BatchNormMLP
    from worker.probe import model_noise

    def noise(workload: Workload, **config: Any) -> tuple[str, ...]:
        config = workload.resolve({"seed": 1, "data_seed": 0, **config})
        torch.manual_seed(1)
        model = workload.build_model(config)
        train_split, _ = workload.data(config)
        n = int(config.get("batch_size", 64))
        return model_noise(workload, model, (train_split.x[:n], train_split.y[:n]))

    assert noise(BatchNormMLP()) == ("net.0.bias", "net.3.bias")
    assert noise(get_workload("digits-mlp"), batch_norm=True) == ("0.bias", "3.bias")
    assert noise(get_workload("digits-mlp")) == ()
    assert noise(get_workload("digits-cnn")) == ()
    assert noise(get_workload("resnet-cifar"), width=4, n_train=256, n_val=128) == ()


def test_a_failed_vmap_step_leaves_nothing_behind_when_its_members_go_on_alone() -> None:
    """A training forward that counts its steps (a Python counter) and shrinks a weight in
    place, then calls .item(): the fused vmap step fails and the members go on one at a time.
    Before, what the failed attempt had changed stayed, and the retry made it again: each
    member's counter ended a step ahead of its trial's alone, its weights ~1% apart."""
    workload = SideEffectMLP()
    members = [member(f"e{i}", 80 + i, lr=0.05 * (i + 1)) for i in range(3)]
    array = FusedArray(workload, members)
    assert array.stacks == [(["e0", "e1", "e2"], "vmap")]
    train(array, EPOCHS * array.steps_per_epoch)
    assert array.stacks == [(["e0"], "serial"), (["e1"], "serial"), (["e2"], "serial")]
    assert any("vmap could not run the fused step" in n for n in array.notes), array.notes
    steps = EPOCHS * array.steps_per_epoch
    assert [array.python_values(k)["model"]["steps"] for k, _ in members] == [steps] * 3
    assert_as_alone(workload, array, members)


def test_a_forward_vmap_cannot_run_in_eval_mode_evaluates_its_members_one_at_a_time() -> None:
    """A forward that calls .item() only in eval mode trains under vmap; at the first
    evaluation the fused forward fails, and the members are evaluated, and train on, one at a
    time: the reports and weights of each are its trial's alone, and the failed evaluation
    left nothing behind (the forward's count of evaluations). Before, the evaluation had no
    fallback: every member of the pack failed (vmap's RuntimeError) while alone each trained."""
    workload = EvalItemMLP()
    members = [member(f"v{i}", 90 + i, lr=0.05 * (i + 1)) for i in range(3)]
    array = FusedArray(workload, members)
    assert array.stacks == [(["v0", "v1", "v2"], "vmap")]
    reports = train(array, EPOCHS * array.steps_per_epoch)
    assert array.stacks == [(["v0"], "serial"), (["v1"], "serial"), (["v2"], "serial")]
    assert any("vmap could not run the fused evaluation" in n for n in array.notes), array.notes
    for key, config in members:
        alone = train(FusedArray(workload, [(key, config)]), EPOCHS * array.steps_per_epoch)
        for got, want in zip(reports, alone, strict=True):
            assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
    assert_as_alone(workload, array, members)


class _Recurrent(nn.Module):
    """The 64 pixels as 8 steps of 8, an LSTM over them, its last output to a head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x.view(-1, 8, 8))
        return self.head(out[:, -1])


class _RecurrentMLP(HiddenActMLP):
    name = "recurrent-digits"

    def build_model(self, config: Mapping[str, Any]) -> Any:
        return _Recurrent(int(self.resolve(config)["hidden"]))


def test_an_lstm_is_one_model_for_the_guard_whatever_its_weights() -> None:
    """An LSTM keeps its parameters in a list too (``_flat_weights``), which the guard read
    by value, a different one per member: every member was a model apart, and the warning
    blamed parameter 'seed', to be declared structural. They are one model now: vmap, which
    cannot batch an LSTM, fails its first step, and they go on one at a time with a note
    saying so, as alone."""
    workload = _RecurrentMLP()
    members = [member(f"r{i}", 40 + i, lr=0.02 * (i + 1)) for i in range(3)]
    array = trained(workload, members)
    assert array.warning is None, array.warning
    assert any("vmap could not run" in note for note in array.notes), array.notes
    assert_as_alone(workload, array, members)


def test_members_that_differ_by_their_seed_alone_are_not_told_to_declare_it() -> None:
    """A model drawn from the seed (its width): the warning says what differs, not
    "parameter 'seed' ... declare the parameter structural", which no one can act on."""

    class Drawn(HiddenActMLP):
        name = "drawn-width"

        def build_model(self, config: Mapping[str, Any]) -> Any:
            width = 16 + 8 * (int(self.resolve(config)["seed"]) % 2)
            return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    array = FusedArray(Drawn(), [member(f"d{i}", 50 + i) for i in range(2)])
    assert array.warning is not None
    assert "in something build_model makes per trial" in array.warning
    assert "Declare the parameter" not in array.warning


class _DropoutAndFunctional(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.body(x), 0.2, self.training)


def test_the_probe_tells_dropout_modules_draws_from_others() -> None:
    """Draws that stop with every nn.Dropout's p at 0 were theirs; a functional dropout
    beside them is not, and neither is a draw training showed after the probe (else the
    pack that learned it would fuse again, and again)."""
    from worker.probe import _LEARNED, learn_draws, probe, probe_key

    workload = TinyMLP()
    config = workload.resolve({"seed": 1, "data_seed": 0, "dropout": 0.5})
    train_split = workload.data(config, torch.device("cpu"))[0]
    batches = [(train_split.x[:n], train_split.y[:n]) for n in (4, 16)]
    model = workload.build_model(config)
    assert probe(workload, model, "dropout-only", batches).dropout_only
    both = _DropoutAndFunctional(workload.build_model(config))
    seen = probe(workload, both, "dropout-and-functional", batches)
    assert seen.draws and not seen.dropout_only
    plain = workload.build_model(workload.resolve({"seed": 1, "data_seed": 0}))
    assert not probe(workload, plain, "no-dropout", batches).dropout_only  # draws nothing
    key = probe_key(workload, "dropout-only")
    try:
        learn_draws(key, torch_draws=True, host_draws=False)
        assert not probe(workload, model, "dropout-only", batches).dropout_only
    finally:
        _LEARNED.pop(key, None)
