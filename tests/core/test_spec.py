"""Study spec validation: every rule names the field it rejects."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from packtune.errors import SpecError
from packtune.spec import MAX_TRIALS, StoredSpec, StudySpec, validate_spec

GOOD: dict[str, Any] = {
    "name": "digits-mlp-lr",
    "workload": "digits-mlp",
    "objective": {"metric": "val_loss", "mode": "min"},
    "space": {
        "lr": {"type": "loguniform", "low": 1e-4, "high": 0.3},
        "momentum": {"type": "uniform", "low": 0.0, "high": 0.99},
        "hidden": {"type": "choice", "values": [64, 128]},
    },
    "hyperband": {"max_resource": 27, "min_resource": 1, "eta": 3},
    "packing": {"enabled": True, "max_pack_size": None},
    "seed": 0,
}


def with_(path: str, value: Any) -> dict[str, Any]:
    """GOOD with the value at dotted ``path`` replaced (``...`` deletes it)."""
    spec = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node = spec
    for part in parents:
        node = node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return spec


def rejected(raw: Any) -> SpecError:
    with pytest.raises(SpecError) as info:
        validate_spec(raw)
    return info.value


def test_the_design_example_is_valid() -> None:
    spec = validate_spec(GOOD)
    assert isinstance(spec, StudySpec)
    assert spec.hyperband.max_resource == 27
    assert spec.total_trials() == 49  # docs/design.md: R=27, eta=3 gives 49 trials
    assert set(spec.dimensions()) == {"lr", "momentum", "hidden"}
    # The dumped form validates again to the same spec (it is what the store keeps).
    assert validate_spec(spec.model_dump(mode="json")) == spec


def test_defaults_fill_the_optional_parts() -> None:
    spec = validate_spec(
        {"name": "x", "workload": "digits-mlp", "space": {}, "hyperband": {"max_resource": 9}}
    )
    assert spec.objective.metric == "val_loss" and spec.objective.mode == "min"
    assert (spec.hyperband.min_resource, spec.hyperband.eta) == (1, 3)
    assert spec.packing.enabled is True and spec.packing.max_pack_size is None
    assert spec.seed == 0
    assert (spec.sampler.name, spec.scheduler) == ("tpe", "hyperband")
    assert spec.budget.iterations() == 1  # no budget: one Hyperband iteration
    assert validate_spec({**GOOD, "budget": {"max_seconds": 60}}).budget.iterations() > 1
    assert validate_spec({**GOOD, "sampler": "random"}).sampler.name == "random"
    assert spec.training.mode == "end_to_end" and spec.training.lane == ""
    decoupled = validate_spec({**GOOD, "training": {"mode": "decoupled", "segments": 3}})
    assert (decoupled.training.segments, decoupled.training.noise) == (3, 0.1)
    stored = StoredSpec.of({**GOOD, "training": {"mode": "decoupled", "segments": 3}})
    assert stored.training == decoupled.training and stored.training.lane == "decoupled:3:0.1"
    assert decoupled.training.segment_units == 0  # a trial is one unit unless asked
    units = validate_spec({**GOOD, "training": {"mode": "decoupled", "units": "segment"}})
    # its trials never share an array with those that train their segments together
    assert units.training.segment_units == 2 and units.training.lane != "decoupled:2:0.1"
    # a study stored before training modes existed trains end to end
    assert StoredSpec.of({"hyperband": {"max_resource": 9}}).training.mode == "end_to_end"
    # a study stored before samplers existed keeps being sampled as it was: at random
    assert StoredSpec.of({"hyperband": {"max_resource": 9}}).sampler.name == "random"


@pytest.mark.parametrize(
    ("path", "value", "field", "words"),
    [
        ("hyperband.eta", 1, "hyperband.eta", "greater than or equal to 2"),
        ("hyperband.eta", 2.5, "hyperband.eta", "integer"),
        ("hyperband.eta", "3", "hyperband.eta", "integer"),
        ("hyperband.max_resource", 10**9, "hyperband.max_resource", "at most 10000"),
        ("hyperband.max_resource", 0, "hyperband.max_resource", "greater than 0"),
        ("hyperband.max_resource", float("inf"), "hyperband.max_resource", "finite"),
        ("hyperband.max_resource", "27", "hyperband.max_resource", "number"),
        ("hyperband.min_resource", 81, "hyperband.max_resource", ">= min_resource"),
        ("hyperband.min_resource", 1e-9, "hyperband", f"more than {MAX_TRIALS}"),
        ("space.lr.low", 1.0, "space.lr.low", "greater than high"),
        ("space.lr.low", 0, "space.lr.low", "greater than 0"),
        ("space.lr.type", "normal", "space.lr.type", "must be one of"),
        ("space.hidden.values", [], "space.hidden.values", "empty"),
        ("space.momentum.high", 0.0, "space.momentum.high", "empty range"),
        ("space.depth", {"type": "int", "low": 1, "high": 3}, "space.depth", "does not take"),
        ("space.seed", {"type": "int", "low": 0, "high": 3}, "space.seed", "set by packtune"),
        ("space.data_seed", {"type": "choice", "values": [1]}, "space.data_seed", "packtune"),
        ("workload", "no-such-workload", "workload", "unknown workload"),
        ("workload", ..., "workload", "required"),
        ("hyperband", ..., "hyperband", "required"),
        ("objective.mode", "best", "objective.mode", "'min' or 'max'"),
        ("objective.metric", "val_acc", "objective.metric", "does not report 'val_acc'"),
        ("colour", "blue", "colour", "unknown key"),
        ("hyperband.speed", 2, "hyperband.speed", "unknown key"),
        ("name", "   ", "name", "at least 1 character"),
        ("name", "x" * 201, "name", "at most 200"),
        ("name", "study\u0085two", "name", "U+0085"),
        ("name", "evil\u202egnp.exe", "name", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
        ("name", "zero\u200bwidth", "name", "U+200B (ZERO WIDTH SPACE)"),
        # a categorical value the workload does not take (it failed every trial of it)
        ("space.activation", {"type": "choice", "values": ["relu", "rleu"]},
         "space.activation.values", "value 'rleu' (position 1) is not one digits-mlp takes"),
        ("space.activation", {"type": "uniform", "low": 0, "high": 1}, "space.activation",
         "takes one of ['relu', 'tanh', 'gelu']"),
        # a value of another kind than the parameter's default failed every trial of it when
        # built (null), or was cut silently (32.5 trained 32 hidden units)
        ("space.hidden", {"type": "choice", "values": [None, 64]}, "space.hidden.values",
         "value None (position 0) is not what digits-mlp takes for hidden: whole numbers"),
        ("space.hidden", {"type": "choice", "values": [32.5]}, "space.hidden.values",
         "whole numbers"),
        ("space.hidden", {"type": "uniform", "low": 10, "high": 20}, "space.hidden.type",
         "use type: int"),
        ("space.lr", {"type": "choice", "values": ["fast"]}, "space.lr", "'fast' is not a number"),
        ("space.dropout", {"type": "choice", "values": [0.1, "x"]}, "space.dropout.values",
         "value 'x' (position 1) is not what digits-mlp takes for dropout: numbers"),
        ("space.nesterov", {"type": "choice", "values": ["yes", "no"]},
         "space.nesterov.values", "true or false"),
        # the optimizer's own ranges: a negative lr or a momentum of 2 diverged every trial
        ("space.lr", {"type": "uniform", "low": -1, "high": -0.1}, "space.lr",
         "-1.0 is outside (0, inf)"),
        ("space.lr", {"type": "choice", "values": [0.1, 0]}, "space.lr", "outside (0, inf)"),
        ("space.momentum", {"type": "uniform", "low": 2, "high": 5}, "space.momentum",
         "outside [0, 1]"),
        ("space.weight_decay", {"type": "uniform", "low": -1, "high": 0},
         "space.weight_decay", "outside [0, inf)"),
        ("space.beta2", {"type": "choice", "values": [0.99, 1.0]}, "space.beta2",
         "outside [0, 1)"),
        # rungs of no training step measured nothing: their trials were never promoted
        ("hyperband", {"max_resource": 0.01, "min_resource": 0.001, "eta": 3},
         "hyperband.min_resource", "every rung must train at least one step"),
        # the owner is shown beside the name (API, CLI, dashboard): the same rules
        ("owner", "a\x00b", "owner", "control or invisible"),
        ("owner", "evil\u202eteam", "owner", "U+202E"),
        ("owner", "   ", "owner", "at least 1 character"),
        ("space.hidden.values", list(range(1001)), "space.hidden.values", "at most 1000"),
        ("seed", -1, "seed", "greater than or equal to 0"),
        ("packing.max_pack_size", 0, "packing.max_pack_size", "greater than or equal to 1"),
        ("packing.enabled", "yes", "packing.enabled", "boolean"),
        ("sampler", "bohb", "sampler.name", "'tpe' or 'random'"),
        (
            "sampler",
            {"name": "tpe", "random_fraction": 1.5},
            "sampler.random_fraction",
            "less than or equal to 1",
        ),
        ("scheduler", "pbt", "scheduler", "'hyperband' or 'asha'"),
        ("budget", {"max_iterations": 0}, "budget.max_iterations", "greater than or equal to 1"),
        ("budget", {"max_seconds": -5}, "budget.max_seconds", "greater than 0"),
        ("budget", {"max_trials": "many"}, "budget.max_trials", "integer"),
        ("budget", {"target": float("nan")}, "budget.target", "finite"),
        ("budget", {"max_iterations": 5000}, "budget.max_iterations", f"more than {MAX_TRIALS}"),
        ("budget", {"deadline": 3}, "budget.deadline", "unknown key"),
        ("training", {"mode": "greedy"}, "training.mode", "'end_to_end' or 'decoupled'"),
        ("training", {"mode": "decoupled", "segments": 1}, "training.segments",
         "greater than or equal to 2"),
        ("training", {"mode": "decoupled", "noise": -1.0}, "training.noise",
         "greater than or equal to 0"),
        ("training", {"mode": "decoupled", "units": "layer"}, "training.units",
         "'trial' or 'segment'"),
        ("training", {"units": "segment"}, "training.units", "segment needs mode: decoupled"),
        # settings that another setting makes moot were accepted and ignored, silently
        ("training", {"segments": 5}, "training.segments", "applies only to mode: decoupled"),
        ("training", {"mode": "end_to_end", "noise": 0.3}, "training.noise",
         "applies only to mode: decoupled"),
        ("packing", {"enabled": False, "max_pack_size": 16}, "packing.max_pack_size",
         "applies only with packing enabled: true"),
        ("sampler", {"name": "random", "random_fraction": 0.5}, "sampler.random_fraction",
         "applies only to sampler tpe"),
    ],
)  # fmt: skip
def test_each_rule_names_its_field(path: str, value: Any, field: str, words: str) -> None:
    error = rejected(with_(path, value))
    assert error.field == field
    assert words in error.message
    assert str(error) == f"{field}: {error.message}"


@pytest.mark.parametrize(
    ("workload", "space", "hyperband"),
    [
        # a streamed workload: its size was not asked (its study trained rungs of no step,
        # measured nothing and failed: "no trial reached max_resource")
        ("digits-files", {"lr": {"type": "loguniform", "low": 0.01, "high": 0.3}},
         {"max_resource": 0.001, "min_resource": 0.001, "eta": 3}),
        # two dimensions that are fine alone: 1,000 examples in batches of 1,000 is one step
        # an epoch, and its rungs at 1/8 to 1/2 epoch none (five trials never measured)
        ("synthetic-mlp", {"n_train": {"type": "choice", "values": [1000, 8192]},
                           "batch_size": {"type": "choice", "values": [64, 1000]}},
         {"max_resource": 1, "min_resource": 0.125, "eta": 2}),
    ],
)  # fmt: skip
def test_rungs_of_no_training_step_are_rejected_wherever_the_space_makes_them(
    workload: str, space: dict[str, Any], hyperband: dict[str, Any]
) -> None:
    raw = {**copy.deepcopy(GOOD), "workload": workload, "space": space, "hyperband": hyperband}
    error = rejected(raw)
    assert error.field == "hyperband.min_resource"
    assert "every rung must train at least one step" in error.message


def test_a_max_trials_too_small_to_reach_max_resource_is_rejected() -> None:
    """Hyperband starts a bracket only when all of its trials fit: with R=27, eta=3 the
    first bracket has 27, so max_trials 20 sampled nothing and the study failed. ASHA cuts
    its last batch to what is left, but promotes floor(m / eta) of m at each rung: its 20
    trials ran, none reached max_resource (6, then 2, then 0), and the study failed too."""
    hyperband = {"max_resource": 27, "min_resource": 1, "eta": 3}
    spec = {**with_("hyperband", hyperband), "budget": {"max_trials": 20}}
    error = rejected(spec)
    assert (
        error.field == "budget.max_trials" and "the 27 trials of the first bracket" in error.message
    )
    assert validate_spec({**spec, "budget": {"max_trials": 27}}).budget.max_trials == 27
    asha = {**spec, "scheduler": "asha"}
    error = rejected(asha)
    assert error.field == "budget.max_trials" and "the 27 trials ASHA needs" in error.message
    assert validate_spec({**asha, "budget": {"max_trials": 28}}).budget.max_trials == 28
    small = {**asha, "hyperband": {"max_resource": 3, "eta": 3}, "budget": {"max_trials": 2}}
    assert "the 3 trials ASHA needs" in rejected(small).message


def test_a_spec_that_is_not_a_mapping_is_rejected() -> None:
    assert rejected([1, 2]).field == "spec"
    assert rejected(None).field == "spec"


def test_fractional_resources_are_allowed() -> None:
    spec = validate_spec(with_("hyperband", {"max_resource": 0.9, "min_resource": 0.1}))
    assert [len(bracket) for bracket in spec.brackets()] == [3, 2, 1]


def test_the_trial_cap_counts_every_bracket() -> None:
    # eta=2 up to 8192: 14 brackets, the top one alone 8192 trials; under the cap.
    ok = validate_spec(with_("hyperband", {"max_resource": 8192, "eta": 2}))
    assert 8192 < ok.total_trials() <= MAX_TRIALS
    too_many = rejected(with_("hyperband", {"max_resource": 10_000, "min_resource": 0.01}))
    assert too_many.field == "hyperband"


def test_a_stored_spec_is_read_once_into_typed_fields_with_the_specs_defaults() -> None:
    stored = validate_spec(copy.deepcopy(GOOD)).model_dump(mode="json")
    spec = StoredSpec.of(stored)
    assert (spec.workload, spec.seed) == (GOOD["workload"], GOOD["seed"])
    assert spec.hyperband == validate_spec(copy.deepcopy(GOOD)).hyperband
    assert spec.brackets == validate_spec(copy.deepcopy(GOOD)).brackets()
    assert spec.packing.align_rungs is True
    # an old or partial row: StudySpec's defaults, not a second copy of them
    bare = StoredSpec.of({"hyperband": {"max_resource": 9}})
    assert (bare.objective.metric, bare.objective.mode) == ("val_loss", "min")
    assert (bare.hyperband.eta, bare.hyperband.min_resource) == (3, 1.0)
    assert (bare.packing.enabled, bare.packing.max_pack_size) == (True, None)
    assert [len(b) for b in bare.brackets] == [3, 2, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        bare.seed = 1  # type: ignore[misc]


def test_a_parameter_name_with_an_invisible_character_is_rejected() -> None:
    spec = copy.deepcopy(GOOD)
    spec["space"]["l\u200dr"] = spec["space"].pop("lr")
    error = rejected(spec)
    assert error.field.startswith("space.") and "U+200D" in error.message


def test_every_admitted_seed_orders_batches_without_overflow() -> None:
    """A seed up to the spec's bound seeds the batch order (it overflowed above ~1.8e13);
    ordinary seeds keep exactly the order they had."""
    import torch

    from packtune.workloads.base import batch_order_seed
    from worker.workloads.digits import DigitsMLP

    assert batch_order_seed(7, 3) == 7 * 1_000_003 + 3
    for seed in (2**45, 2**63 - 1):
        assert 0 <= batch_order_seed(seed, 26) < 2**63
        first = next(iter(DigitsMLP().batch_indices({"data_seed": seed}, 26)))
        assert first.dtype == torch.int64 and len(first) == 64
    assert validate_spec({**GOOD, "seed": 2**63 - 1}).seed == 2**63 - 1


@pytest.mark.parametrize(
    ("space", "field"),
    [
        ({"hidden": {"type": "choice", "values": [64, 2**70]}}, "space.hidden.values"),
        ({"hidden": {"type": "int", "low": 16, "high": 2**40}}, "space.hidden.high"),
        ({"layers": {"type": "int", "low": -1, "high": 2}}, "space.layers.low"),
        ({"dropout": {"type": "uniform", "low": 0.0, "high": 1.5}}, "space.dropout.high"),
    ],
)
def test_values_a_workload_cannot_build_are_rejected_by_its_bounds(
    space: dict[str, Any], field: str
) -> None:
    error = rejected({**GOOD, "space": space})
    assert error.field == field and "outside what digits-mlp takes" in error.message


@pytest.mark.parametrize(
    "space,field,message",
    [
        ({"optimizer": {"type": "choice", "values": ["sgd", "lion"]}}, "space.optimizer",
         "'lion' is not one of sgd, adam, adamw, rmsprop, adagrad, adadelta"),
        ({"schedule": {"type": "choice", "values": ["cosine", "poly"]}}, "space.schedule",
         "'poly' is not one of constant, step, cosine"),
        ({"schedule": {"type": "uniform", "low": 0, "high": 1}}, "space.schedule",
         "a range; give a choice of constant, step, cosine"),
        ({"gamma": {"type": "uniform", "low": 0.1, "high": 2.0}}, "space.gamma",
         "2.0 is outside [0, 1]"),
        ({"clip_norm": {"type": "choice", "values": [1.0, -1.0]}}, "space.clip_norm",
         "-1.0 is outside [0, inf)"),
        ({"warmup_epochs": {"type": "choice", "values": ["two"]}}, "space.warmup_epochs",
         "'two' is not a number"),
    ],
)  # fmt: skip
def test_training_parameters_take_only_what_the_fused_optimizer_knows(
    space: dict[str, Any], field: str, message: str
) -> None:
    error = rejected({**GOOD, "space": space})
    assert error.field == field and message in error.message, error


@pytest.mark.parametrize(
    ("default", "message"),
    [
        ({"precision": "fp16"}, "precision='fp16' by default: 'fp16' is not one of fp32, bf16"),
        ({"optimizer": "lion"}, "declares optimizer='lion' by default: 'lion' is not one of"),
        ({"momentum": 1.5}, "declares momentum=1.5 by default: 1.5 is outside [0, 1]"),
    ],
)  # fmt: skip
def test_a_workloads_own_training_defaults_must_be_known_too(
    monkeypatch: pytest.MonkeyPatch, default: dict[str, Any], message: str
) -> None:
    """A workload declaring ``precision: "fp16"`` (or a typo of ``bf16``) was accepted and
    trained in float32 without a word (found by an audit): only the space's values were
    checked. Its own defaults are now, naming the workload."""
    from packtune.workloads import get_workload, registry

    workload = copy.copy(get_workload("digits-mlp"))
    workload.params = {**workload.params, **default}
    monkeypatch.setitem(registry(), "digits-mlp", workload)
    error = rejected({**GOOD, "space": {}})
    assert error.field == "workload" and message in error.message, error
    # a space that searches the parameter decides it: the default is then not used
    name, value = next(iter(default.items()))
    if name == "precision":
        space = {"precision": {"type": "choice", "values": ["fp32"]}}
        assert validate_spec({**GOOD, "space": space}).space == space


def test_a_schedule_and_the_new_optimizers_are_searchable() -> None:
    space = {
        "optimizer": {"type": "choice", "values": ["sgd", "rmsprop", "adagrad", "adadelta"]},
        "schedule": {"type": "choice", "values": ["constant", "step", "cosine"]},
        "warmup_epochs": {"type": "uniform", "low": 0.0, "high": 2.0},
        "clip_norm": {"type": "loguniform", "low": 0.1, "high": 10.0},
    }
    assert set(validate_spec({**GOOD, "space": space}).space) == set(space)


def test_the_objective_ranks_in_the_direction_the_workload_declares() -> None:
    """A spec that names ``val_accuracy`` without a mode maximises it (minimising by default
    would pick the worst trial); one that says ``min`` for it is rejected, naming the field."""
    base = {"name": "acc", "workload": "digits-mlp", "space": {}, "hyperband": {"max_resource": 3}}
    spec = validate_spec({**base, "objective": {"metric": "val_accuracy"}})
    assert spec.objective.mode == "max"
    assert spec.model_dump(mode="json")["objective"] == {"metric": "val_accuracy", "mode": "max"}
    assert validate_spec({**base, "objective": {"metric": "val_loss"}}).objective.mode == "min"
    with pytest.raises(SpecError) as caught:
        validate_spec({**base, "objective": {"metric": "val_accuracy", "mode": "min"}})
    assert caught.value.field == "objective.mode"
    assert "better when higher" in str(caught.value)


@pytest.mark.parametrize(
    "extra",
    [{"sampler": "random"}, {"packing": {"enabled": False}}, {"training": {"mode": "end_to_end"}},
     {"training": {"mode": "decoupled", "segments": 3, "noise": 0.2}},
     {"sampler": {"name": "tpe", "random_fraction": 0.5}}],
)  # fmt: skip
def test_a_spec_dumped_whole_is_valid_again(extra: dict[str, Any]) -> None:
    """The CLI submits a spec dumped with every default named: the rules against settings
    made moot by another compare with the defaults, so a dump is never refused."""
    spec = validate_spec({**with_("seed", 0), **extra})
    again = validate_spec(spec.model_dump(mode="json"))
    assert again == spec


DECOUPLED = {"mode": "decoupled", "segments": 2}
TASK = {"type": "choice", "values": ["regression"]}


@pytest.mark.parametrize(
    ("workload", "space", "training", "field", "words"),
    [
        # more segments than layers with parameters: every trial failed when built
        ("digits-mlp", {}, {"mode": "decoupled", "segments": 4}, "training.segments",
         "at most 3 segments"),
        ("digits-mlp", {"layers": {"type": "int", "low": 0, "high": 4}}, DECOUPLED,
         "training.segments", "1 layer with parameters at layers=0"),
        ("digits-cnn", {}, {"mode": "decoupled", "segments": 4}, "training.segments",
         "at most 3 segments"),
        ("resnet-cifar", {}, DECOUPLED, "training.mode", "not a plain nn.Sequential"),
        # a regression: its float targets were an IndexError per member
        ("synthetic-mlp", {"task": TASK}, DECOUPLED, "training.mode",
         "not class labels at task='regression'"),
        ("synthetic-mlp", {"task": {"type": "choice", "values": ["classification", "regression"]}},
         DECOUPLED, "training.mode", "not class labels at task='regression'"),
        ("digits-files", {}, DECOUPLED, "training.mode", "streams its batches"),
    ],
)  # fmt: skip
def test_a_decoupled_study_its_model_or_data_cannot_train_is_rejected(
    workload: str, space: dict[str, Any], training: dict[str, Any], field: str, words: str
) -> None:
    """Each was accepted, and every trial of it failed when its array was built (``cannot
    train decoupled: ...``); the workload's declarations say so without torch."""
    error = rejected({**GOOD, "workload": workload, "space": space, "training": training})
    assert error.field == field and words in error.message, error


@pytest.mark.parametrize(
    ("workload", "space", "segments"),
    [
        ("digits-mlp", {}, 3),
        ("digits-mlp", {"layers": {"type": "int", "low": 2, "high": 4},
                        "batch_norm": {"type": "choice", "values": [True]}}, 5),
        ("digits-cnn", {"batch_norm": {"type": "choice", "values": [True, False]}}, 3),
        ("synthetic-mlp", {"task": {"type": "choice", "values": ["classification"]}}, 3),
    ],
)  # fmt: skip
def test_a_decoupled_study_its_models_can_be_cut_into_is_accepted(
    workload: str, space: dict[str, Any], segments: int
) -> None:
    training = {"mode": "decoupled", "segments": segments}
    spec = validate_spec({**GOOD, "workload": workload, "space": space, "training": training})
    assert spec.training.segments == segments


@pytest.mark.parametrize(
    ("space", "metric", "words"),
    [
        ({}, "val_r2", "'val_accuracy', 'val_loss'], not 'val_r2'"),
        ({"task": {"type": "choice", "values": ["classification"]}}, "val_r2",
         "'val_accuracy', 'val_loss'], not 'val_r2'"),
        ({"task": {"type": "choice", "values": ["regression", "classification"]}}, "val_r2",
         "at task='classification', not 'val_r2'"),
        ({"task": TASK}, "val_accuracy", "'val_r2'] at task='regression', not 'val_accuracy'"),
    ],
)  # fmt: skip
def test_an_objective_some_configuration_never_reports_is_rejected(
    space: dict[str, Any], metric: str, words: str
) -> None:
    """synthetic-mlp reports val_accuracy for a classification and val_r2 for a regression:
    the other metric was accepted, and every trial of it failed at its first measurement."""
    error = rejected({**GOOD, "workload": "synthetic-mlp", "space": space,
                      "objective": {"metric": metric}})  # fmt: skip
    assert error.field == "objective.metric" and words in error.message, error
    assert "val_loss" in error.message  # what it does report there


def test_an_objective_every_configuration_reports_is_accepted() -> None:
    spec = validate_spec({**GOOD, "workload": "synthetic-mlp", "space": {"task": TASK},
                          "objective": {"metric": "val_r2"}})  # fmt: skip
    assert (spec.objective.metric, spec.objective.mode) == ("val_r2", "max")
    both = {"task": {"type": "choice", "values": ["classification", "regression"]}}
    spec = validate_spec({**GOOD, "workload": "synthetic-mlp", "space": both})
    assert spec.objective.metric == "val_loss"  # reported by every workload
